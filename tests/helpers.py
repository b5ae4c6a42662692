"""Helpers the test directories share (imported as `helpers`: pytest puts this folder on sys.path, the folder of
the root conftest.py)."""
import torch


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """A standard normal tensor of `shape` drawn from its own generator seeded with `seed`."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, **tolerance: float) -> None:
    """torch.testing.assert_close whose failure message starts with `what` (the rank, the case, the tensor)."""
    torch.testing.assert_close(got, want, msg=lambda message: f"{what}: {message}", **tolerance)
