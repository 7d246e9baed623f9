"""`python -m rla_lib.graphs capture MODEL {vllm|hf} {compiled|eager} DIR`: one engine capture (see captures.capture)."""

from .captures import main

main()
