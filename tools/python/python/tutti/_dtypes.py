"""The dtypes tutti reduces, by the names the native half takes."""


def torch_names() -> dict:
    """torch dtype → tutti dtype name (imports torch; call only when torch is in use)."""
    import torch

    return {
        torch.float32: "float32",
        torch.float64: "float64",
        torch.float16: "float16",
        torch.bfloat16: "bfloat16",
        torch.int8: "int8",
        torch.uint8: "uint8",
        torch.int32: "int32",
        torch.int64: "int64",
    }
