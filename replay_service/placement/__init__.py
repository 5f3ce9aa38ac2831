"""Where service code runs: on the event loop or in a thread (`on_loop`), in one process or in one of `serve`'s
workers (`processes`)."""
