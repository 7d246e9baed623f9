"""One naming scheme for the sides that compute or score the same tokens, in measurements, graphs and tables:

- `vllm:<mode>`: the engine, mode "compiled" or "eager" (`engine`);
- `hf:bf16:<config>`: Transformers eager in BF16 under an alignment configuration, `none` = stock (`training`);
- `hf:fp32`: Transformers in FP32 (`FP32`), the zero-mismatch reference;
- `hf:compiled`: torch.compile of stock BF16 Transformers (`HF_COMPILED`), a third "engine" read by rla_lib.graphs.

Keys are built here and never parsed back; display labels are made from them, not the other way round.
"""

STOCK = "hf:bf16:none"
FP32 = "hf:fp32"
HF_COMPILED = "hf:compiled"


def engine(mode: str) -> str:
    return f"vllm:{mode}"


def training(config: str = "none") -> str:
    return f"hf:bf16:{config}"
