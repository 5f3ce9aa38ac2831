"""`python -m capture.vllm.sink FD`: the sink process's entry (see `capture.vllm.sink.process`)."""

import sys

from capture.vllm.sink.process import main

sys.exit(main(int(sys.argv[1])))
