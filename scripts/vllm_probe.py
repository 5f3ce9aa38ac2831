#!/usr/bin/env python3
"""Prototype: capture MoE routing inside vLLM (CPU build) from a general plugin.

Research aid for the capture/ plugin, not product code. It runs in the isolated
vLLM venv (/work/venv-vllm, see docs/vllm_notes.md), never in the project env.

What it does:
  1. builds a tiny random-weight Qwen3-MoE checkpoint (2 layers, hidden 128,
     8 experts, top-2, float32, vocab 512) plus a local WordLevel tokenizer;
  2. makes a throw-away ``.dist-info`` with a ``vllm.general_plugins`` entry
     point (``routing_probe = vllm_probe:register``) and puts it on PYTHONPATH,
     so every vLLM process (front end, engine core, each spawned worker) loads
     the plugin through ``vllm.plugins.load_general_plugins``;
  3. the plugin (``register`` below, runs in every process) patches the V1
     model runner (``GPUModelRunner``, base of the CPU runner) and binds
     ``BaseRouter.set_capture_fn`` on every MoE layer; each worker writes one
     JSON line per scheduler step: request ids, query_start_loc, positions,
     input token ids, sampled tokens and the top-k ids of every MoE layer;
  4. generates for 3 token-id prompts of different lengths (greedy);
  5. recomputes routing with transformers (float32) over prompt + generated
     tokens and checks that the captured top-k *sets* match per (position,
     layer), that every position 0..T-2 was captured exactly once, that token
     ids match, and (TP>1) that every TP rank captured identical rows.

Usage (one vLLM at a time on the 2-core machine):
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 1
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 2
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 1 --chunk 16   # chunked prefill
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 1 --spec 3     # ngram spec decode
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 1 --repeat     # prefix-cache gap
  /work/venv-vllm/bin/python scripts/vllm_probe.py --tp 1 --monkeypatch-only  # negative control
Exit code 0 when every check passes (--monkeypatch-only is expected to exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# ---------------------------------------------------------------------------
# Plugin side (imported in every vLLM process through the entry point).
# Keep this section free of heavy imports at module level.
# ---------------------------------------------------------------------------

ENV_OUT = "ROUTING_PROBE_OUT"
ENV_VERBOSE = "ROUTING_PROBE_VERBOSE"

_STATE: dict = {
    "patched": False,
    "bound_model": None,  # id() of the model whose routers we bound
    "num_bound": 0,
    "sched": None,  # SchedulerOutput of the step being executed
    "step": None,  # dict filled during the forward pass
    "pending": None,  # step waiting for sample_tokens()
    "step_idx": 0,
    "dummy_captures": 0,  # capture calls outside a real step (profile/dummy runs)
    "fh": None,
    "rank": None,
}


def _log(msg: str) -> None:
    print(f"[routing_probe pid={os.getpid()} rank={_STATE['rank']}] {msg}",
          file=sys.stderr, flush=True)


def _capture(layer_id: int, topk_ids) -> None:
    """Installed as router.capture_fn; called by BaseRouter._select_experts
    (router/base_router.py:296) with *logical* ids, before the EPLB remap."""
    st = _STATE["step"]
    if st is None:
        _STATE["dummy_captures"] += 1
        return
    if not st["layers"]:
        # first MoE layer of the step: look at the forward context once
        from vllm.forward_context import get_forward_context

        ctx = get_forward_context()
        pad = ctx.is_padding
        st["ctx"] = {
            "dp_metadata": ctx.dp_metadata is not None,
            "is_padding_len": None if pad is None else int(pad.shape[0]),
            "is_padding_sum": None if pad is None else int(pad.sum()),
        }
    st["shapes"][layer_id] = list(topk_ids.shape)
    st["layers"][layer_id] = topk_ids.detach().to("cpu", copy=True)


def _bind(runner) -> None:
    model = getattr(runner, "model", None)
    if model is None or _STATE["bound_model"] == id(model):
        return
    from functools import partial

    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    n = 0
    for module in model.modules():
        if isinstance(module, MoERunner) and isinstance(module.router, BaseRouter):
            prev = module.router.capture_fn
            fn = partial(_capture, module.layer_id)
            if prev is not None:  # chain with vLLM's own capturer if present
                def fn(t, _a=fn, _b=prev):  # noqa: E731
                    _a(t)
                    _b(t)
            module.router.set_capture_fn(fn)
            n += 1
    _STATE["bound_model"] = id(model)
    _STATE["num_bound"] = n
    from vllm.distributed.parallel_state import get_tp_group

    _STATE["rank"] = get_tp_group().rank_in_group
    _log(f"bound capture_fn on {n} MoE routers ({type(runner).__name__})")


def _open_out():
    if _STATE["fh"] is None:
        out = os.environ.get(ENV_OUT)
        if not out:
            return None
        os.makedirs(out, exist_ok=True)
        _STATE["fh"] = open(
            os.path.join(out, f"rank{_STATE['rank']}_pid{os.getpid()}.jsonl"), "a"
        )
    return _STATE["fh"]


def _patch_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_execute = GPUModelRunner.execute_model
    orig_forward = GPUModelRunner._model_forward
    orig_sample = GPUModelRunner.sample_tokens
    orig_load = GPUModelRunner.load_model

    def load_model(self, *a, **kw):
        r = orig_load(self, *a, **kw)
        _bind(self)
        return r

    def execute_model(self, scheduler_output, *a, **kw):
        _STATE["sched"] = scheduler_output
        return orig_execute(self, scheduler_output, *a, **kw)

    def _model_forward(self, input_ids=None, positions=None,
                       intermediate_tensors=None, inputs_embeds=None, **kw):
        _bind(self)
        so = _STATE["sched"]
        num_reqs = self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: num_reqs + 1].copy()
        n = int(qsl[-1])
        ids = input_ids if input_ids is not None else self.input_ids.gpu
        st = {
            "step": _STATE["step_idx"],
            "req_ids": list(self.input_batch.req_ids[:num_reqs]),
            "query_start_loc": qsl.tolist(),
            "num_tokens": n,
            "num_tokens_padded": int(positions.shape[-1]) if positions is not None else n,
            "positions": positions[..., :n].cpu().tolist() if positions is not None else None,
            "input_ids": ids[:n].cpu().tolist(),
            "num_computed_tokens": self.input_batch.num_computed_tokens_cpu[:num_reqs].tolist(),
            "sched": None if so is None else {
                "num_scheduled_tokens": dict(so.num_scheduled_tokens),
                "total": so.total_num_scheduled_tokens,
                "new": [r.req_id for r in so.scheduled_new_reqs],
                "cached": list(so.scheduled_cached_reqs.req_ids),
                "resumed": sorted(so.scheduled_cached_reqs.resumed_req_ids),
                "finished": sorted(so.finished_req_ids),
                "preempted": sorted(so.preempted_req_ids or []),
                "spec": {k: list(v) for k, v in so.scheduled_spec_decode_tokens.items()},
            },
            "layers": {},
            "shapes": {},
        }
        _STATE["step"] = st
        try:
            return orig_forward(self, input_ids=input_ids, positions=positions,
                                intermediate_tensors=intermediate_tensors,
                                inputs_embeds=inputs_embeds, **kw)
        finally:
            _STATE["step"] = None
            _STATE["pending"] = st
            _STATE["step_idx"] += 1

    def sample_tokens(self, *a, **kw):
        out = orig_sample(self, *a, **kw)
        st, _STATE["pending"] = _STATE["pending"], None
        if st is None:
            return out
        sampled = {}
        if hasattr(out, "req_ids") and getattr(out, "sampled_token_ids", None) is not None:
            sampled = {rid: list(map(int, toks))
                       for rid, toks in zip(out.req_ids, out.sampled_token_ids)}
        layers = st.pop("layers")
        rec = dict(st)
        rec["sampled"] = sampled
        rec["layers"] = {str(k): v[: st["num_tokens"]].tolist() for k, v in layers.items()}
        rec["dummy_captures_so_far"] = _STATE["dummy_captures"]
        if os.environ.get(ENV_VERBOSE, "1") == "1":
            _log(f"step {st['step']}: req_ids={st['req_ids']} "
                 f"qsl={st['query_start_loc']} positions={st['positions']} "
                 f"topk_ids shapes={ {k: tuple(v) for k, v in st['shapes'].items()} } "
                 f"padded={st['num_tokens_padded']} ctx={st.get('ctx')}")
        fh = _open_out()
        if fh is not None:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
        return out

    GPUModelRunner.load_model = load_model
    GPUModelRunner.execute_model = execute_model
    GPUModelRunner._model_forward = _model_forward
    GPUModelRunner.sample_tokens = sample_tokens
    # CPUModelRunner overrides load_model; wrap it as well.
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        if "load_model" in CPUModelRunner.__dict__:
            cpu_load = CPUModelRunner.load_model

            def cpu_load_model(self, *a, **kw):
                r = cpu_load(self, *a, **kw)
                _bind(self)
                return r

            CPUModelRunner.load_model = cpu_load_model
    except ImportError:
        pass


def register() -> None:
    """vllm.general_plugins entry point. Called in every vLLM process
    (front end, engine core, workers), possibly more than once."""
    if _STATE["patched"]:
        return
    _STATE["patched"] = True
    import multiprocessing as mp

    pname = mp.current_process().name
    t0 = time.perf_counter()
    _patch_runner()
    _log(f"register() in process {pname!r}: patched V1 model runner in "
         f"{(time.perf_counter() - t0) * 1e3:.0f} ms")


# ---------------------------------------------------------------------------
# Driver side.
# ---------------------------------------------------------------------------

NUM_LAYERS, HIDDEN, NUM_EXPERTS, TOP_K, VOCAB = 2, 128, 8, 2, 512


def build_model(path: str, gate_scale: float) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():  # make routing decisive: near-ties would make HF vs vLLM flaky
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(gate_scale)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    vocab.update({"<unk>": 3})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="t1", eos_token="t2", pad_token="t0")
    fast.save_pretrained(path)


def make_plugin_dist(root: str, scripts_dir: str) -> None:
    d = os.path.join(root, "routing_probe_plugin-0.0.0.dist-info")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: routing-probe-plugin\nVersion: 0.0.0\n")
    with open(os.path.join(d, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nrouting_probe = vllm_probe:register\n")
    pp = [root, scripts_dir] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    os.environ["PYTHONPATH"] = ":".join(pp)
    for p in (scripts_dir, root):
        if p not in sys.path:
            sys.path.insert(0, p)


def load_records(out: str) -> dict[int, list[dict]]:
    by_rank: dict[int, list[dict]] = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".jsonl"):
            rank = int(name.split("_")[0][4:])
            with open(os.path.join(out, name)) as f:
                by_rank.setdefault(rank, []).extend(json.loads(line) for line in f)
    return by_rank


def rows_from_records(recs: list[dict]) -> tuple[dict, list[str]]:
    """internal req id -> {position: (token_id, [[ids] per layer])}."""
    rows: dict[str, dict[int, tuple]] = {}
    problems = []
    for rec in recs:
        qsl = rec["query_start_loc"]
        for i, rid in enumerate(rec["req_ids"]):
            s, e = qsl[i], qsl[i + 1]
            # Spec decode: the step ran [last token, d1..dk]; sampled holds the
            # m accepted drafts + 1 bonus token, so rows s..s+m are real and the
            # k-m rows after them are rejected (recomputed next step). Without
            # spec decode every row is real (sampled is [] for a partial
            # prefill chunk, [tok] otherwise).
            end = e
            if rid in (rec["sched"] or {}).get("spec", {}):
                end = s + len(rec["sampled"].get(rid, []))
            for j in range(s, end):
                pos = rec["positions"][j]
                ids = [rec["layers"][str(l)][j] for l in sorted(map(int, rec["layers"]))]
                prev = rows.setdefault(rid, {}).get(pos)
                if prev is not None:
                    problems.append(f"{rid} pos {pos} captured twice (step {rec['step']})")
                rows[rid][pos] = (rec["input_ids"][j], ids)
    return rows, problems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=0,
                    help="max_num_batched_tokens (forces chunked prefill when small)")
    ap.add_argument("--spec", type=int, default=0,
                    help="ngram speculative decoding with this many draft tokens")
    ap.add_argument("--repeat", action="store_true",
                    help="generate the same prompts twice (shows prefix-cache gaps)")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--monkeypatch-only", action="store_true",
                    help="negative control: patch the driver process only, no entry point")
    ap.add_argument("--gate-scale", type=float, default=10.0)
    ap.add_argument("--workdir", default="/tmp/routing_probe")
    args = ap.parse_args()

    import shutil

    work = os.path.join(args.workdir, f"tp{args.tp}_chunk{args.chunk}_spec{args.spec}"
                        f"{'_mp' if args.monkeypatch_only else ''}{'_repeat' if args.repeat else ''}{'_nopc' if args.no_prefix_cache else ''}")
    shutil.rmtree(work, ignore_errors=True)
    model_dir, out_dir, plug_dir = (os.path.join(work, x) for x in ("model", "out", "plugin"))
    os.makedirs(out_dir)
    t = time.perf_counter()
    build_model(model_dir, args.gate_scale)
    print(f"built model in {time.perf_counter() - t:.1f}s at {model_dir}", flush=True)

    if args.monkeypatch_only:
        # negative control: patch only this process, no entry point. On CPU the
        # worker is always a *spawned* process (platforms/cpu.py forces the mp
        # executor and VLLM_WORKER_MULTIPROC_METHOD=spawn), so nothing is captured.
        register()
    else:
        make_plugin_dist(plug_dir, os.path.dirname(os.path.abspath(__file__)))
    os.environ[ENV_OUT] = out_dir
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        # with nobind each worker keeps 2 OMP threads (cpu_worker.py:140 skips
        # set_num_threads): 4 spinning threads on 2 cores made generate ~6x slower
        os.environ.setdefault("OMP_NUM_THREADS", "1")

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=model_dir, tensor_parallel_size=args.tp, enforce_eager=True,
              dtype="float32", max_model_len=128, max_num_seqs=8, seed=0)
    if args.chunk:
        kw.update(max_num_batched_tokens=args.chunk, enable_chunked_prefill=True)
    if args.no_prefix_cache:
        kw.update(enable_prefix_caching=False)
    if args.repeat:  # CPU default block_size is 128 (platforms/cpu.py): too big to hit
        kw.update(block_size=32)
    if args.spec:
        kw.update(speculative_config={"method": "ngram", "num_speculative_tokens": args.spec,
                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    t = time.perf_counter()
    llm = LLM(**kw)
    t_start = time.perf_counter() - t
    print(f"ENGINE START {t_start:.1f}s", flush=True)

    prompts = [[5 + (7 * i) % 500 for i in range(n)] for n in (4, 11, 23)]
    if args.repeat:
        prompts.append([9 + (5 * i) % 500 for i in range(45)])
    if args.spec:  # repetitive prompts so the ngram proposer finds drafts
        prompts = [([10, 11, 12, 13, 14] * 6)[:n] for n in (4, 11, 23)]
    sp = SamplingParams(max_tokens=args.max_tokens if not args.spec else 16, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp)
    if args.repeat:
        # same prompts again: with prefix caching on, full cached blocks of the
        # prompt are never run through the model, so their rows never appear
        outs = list(outs) + list(llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], sp))
    t_gen = time.perf_counter() - t
    print(f"GENERATE {t_gen:.2f}s", flush=True)
    seqs = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine, "engine_core") else None
    del llm

    # ---- checks -----------------------------------------------------------
    import torch
    from transformers import Qwen3MoeForCausalLM

    by_rank = load_records(out_dir)
    ok = True
    print(f"ranks with records: {sorted(by_rank)}; steps per rank: "
          f"{ {r: len(v) for r, v in by_rank.items()} }")
    if sorted(by_rank) != list(range(args.tp)):
        print("FAIL: expected one record file per TP rank")
        ok = False
    hf = Qwen3MoeForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    captured_gate: list = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda m, i, o: captured_gate.append((o[0].detach(), o[2].detach())))
        for layer in hf.model.layers]

    rank_rows = {}
    gaps: list = []
    for rank, recs in sorted(by_rank.items()):
        rows, problems = rows_from_records(recs)
        rank_rows[rank] = rows
        for p in problems:
            print(f"rank {rank}: {p}")
        ok &= not problems
        n_match = n_total = 0
        min_margin = float("inf")
        for rid, pos_rows in rows.items():
            ext = rid.rsplit("-", 1)[0]
            seq = seqs[ext]
            T = len(seq)
            expect = set(range(T - 1))
            if set(pos_rows) != expect:
                missing = sorted(expect - set(pos_rows))
                print(f"rank {rank} {rid}: {len(missing)} positions never captured: "
                      f"{missing[:3]}..{missing[-3:]} (T={T})")
                gaps.append((rid, missing))
                # a gap is only expected for --repeat with prefix caching on
                ok &= bool(args.repeat and not args.no_prefix_cache
                           and missing == list(range(len(missing))))
            captured_gate.clear()
            with torch.no_grad():
                hf(input_ids=torch.tensor([seq[:-1]]))
            for li, (logits, idx) in enumerate(captured_gate):
                top = logits.topk(TOP_K + 1, dim=-1).values
                min_margin = min(min_margin, float((top[:, TOP_K - 1] - top[:, TOP_K]).min()))
                for pos in range(T - 1):
                    if pos not in pos_rows:
                        continue
                    tok, ids = pos_rows[pos]
                    if tok != seq[pos]:
                        print(f"rank {rank} {rid} pos {pos}: token {tok} != {seq[pos]}")
                        ok = False
                    n_total += 1
                    if set(ids[li]) == set(idx[pos].tolist()):
                        n_match += 1
                    else:
                        print(f"rank {rank} {rid} pos {pos} layer {li}: vllm {ids[li]} "
                              f"hf {idx[pos].tolist()}")
        print(f"rank {rank}: {n_match}/{n_total} (position, layer) top-k sets match HF; "
              f"min HF top-k margin {min_margin:.4f}")
        ok &= n_match == n_total and n_total > 0
    for h in hooks:
        h.remove()
    if len(rank_rows) > 1:
        same = all(rank_rows[r] == rank_rows[0] for r in rank_rows)
        print(f"TP ranks captured identical rows: {same}")
        ok &= same
    n_spec = sum(len(r["sched"]["spec"]) for recs in by_rank.values() for r in recs
                 if r["sched"]) // max(1, len(by_rank))
    n_rej = sum(len(v) + 1 - len(r["sampled"].get(k, [])) for r in by_rank.get(0, [])
                if r["sched"] for k, v in r["sched"]["spec"].items())
    if args.repeat:
        print(f"requests with prefix-cache gaps: {len(gaps)}")
        ok &= bool(gaps) != args.no_prefix_cache
    print(f"spec-decode rows: {n_spec} (request, step) pairs had drafts; {n_rej} rows rejected")
    summary = {"tp": args.tp, "chunk": args.chunk, "spec": args.spec, "engine_start_s": round(t_start, 1),
               "generate_s": round(t_gen, 2), "ok": bool(ok),
               "request_ids": {r: sorted(rank_rows[r]) for r in rank_rows},
               "outputs": seqs}
    with open(os.path.join(work, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("SUMMARY " + json.dumps({k: summary[k] for k in
                                    ("tp", "chunk", "spec", "engine_start_s", "generate_s", "ok")}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
