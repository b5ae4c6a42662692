"""What the op families' tests share: the devices they run on, and the bad-input checks every op must pass on its
real kernels and its fake kernel alike."""
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]  # skipped where CUDA is missing (tests/conftest.py)


def huge(shape, dtype=torch.float32, device="cpu"):
    """A tensor of ``shape`` that allocates (almost) nothing: every stride 0 over one element of storage (none when the
    shape holds a 0), so that sizes far past memory, such as ``[0, 2**62, 4]`` or ``[2**61, 2]``, reach an op's
    checks."""
    storage = torch.zeros(0 if 0 in shape else 1, dtype=dtype, device=device)
    return storage.as_strided(shape, [0] * len(shape))


def bad_input_tests(bad_inputs):
    """The two tests of a {name: (call(device), message regex)} table: every call raises a RuntimeError matching
    its message, on every device and on fake tensors (the fake kernel checks what the real one checks)."""

    @pytest.mark.parametrize("device", DEVICES)
    @pytest.mark.parametrize("call, message", bad_inputs.values(), ids=bad_inputs.keys())
    def test_bad_inputs_raise_a_clear_error(device, call, message):
        with pytest.raises(RuntimeError, match=message):
            call(device)

    @pytest.mark.parametrize("call, message", bad_inputs.values(), ids=bad_inputs.keys())
    def test_fake_kernels_reject_bad_inputs_like_the_real_ones(call, message):
        with torch._subclasses.fake_tensor.FakeTensorMode(), pytest.raises(RuntimeError, match=message):
            call("cpu")

    return test_bad_inputs_raise_a_clear_error, test_fake_kernels_reject_bad_inputs_like_the_real_ones
