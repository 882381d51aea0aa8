"""The torch device the quality models run on."""


def resolve(device: str) -> str:
    """`auto` is the first CUDA device where there is one, else the CPU; anything else is used as given."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
