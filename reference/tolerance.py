"""How close an implementation must be to the float64 reference: a multiple of PyTorch's own error.

For inputs in ``dtype``: ``|actual - truth| <= 2 * |pytorch_lp - truth| + FLOOR_EPS * eps(dtype) *
max(1, |truth|)``, where ``truth`` is the reference in float64 and ``pytorch_lp`` the same reference
computed in ``dtype`` (flash-attention's rule). The floor covers cases where PyTorch happens to be
almost exact: kernels sum in another order and use exp2 with folded constants.

:func:`check_flash_rule` is flash-attention's own test rule, without the floor: ``max |actual - truth|
<= 3 * max |pytorch_lp - truth| + 1e-5`` (``tests/test_flash_attn.py``, ``test_flash_attn_kvcache``).
It is stricter where PyTorch happens to be nearly exact, and is what a port of that grid is judged by.
"""

import torch

FLOOR_EPS = 16


def error_bound(truth: torch.Tensor, pytorch_lp: torch.Tensor, dtype: torch.dtype) -> float:
    pt_err = (pytorch_lp.to(torch.float64) - truth).abs().max().item()
    floor = FLOOR_EPS * torch.finfo(dtype).eps * max(1.0, truth.abs().max().item())
    return 2 * pt_err + floor


def check_close(name: str, actual: torch.Tensor, truth: torch.Tensor, pytorch_lp: torch.Tensor, dtype: torch.dtype):
    """Raise ``AssertionError`` naming ``name``, the bound and the worst element if ``actual`` is too far.

    NaN in ``actual`` always fails; an infinity (an empty state's ``lse = -inf``) must equal the
    truth's exactly, and the bound applies to the finite rest."""
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    truth = truth.detach().to(device="cpu", dtype=torch.float64)
    pytorch_lp = pytorch_lp.detach().cpu()
    n_nan = int(torch.isnan(actual).sum())
    if n_nan:
        raise AssertionError(f"{name}: {n_nan} NaN elements")
    infinite = torch.isinf(actual) | torch.isinf(truth)
    if not torch.equal(actual[infinite], truth[infinite]):
        raise AssertionError(f"{name}: infinite elements where the truth differs (an empty state is -inf in both)")
    if bool(infinite.all()):
        return
    finite = ~infinite
    err = torch.where(finite, actual - truth, 0.0).abs()
    bound = error_bound(truth[finite], pytorch_lp.to(torch.float64)[finite], dtype)
    worst = err.max().item()
    if worst > bound:
        idx = tuple(int(i) for i in torch.nonzero(err == err.max())[0])
        raise AssertionError(f"{name}: max error {worst:.3g} > bound {bound:.3g} ({dtype}) at {idx}: "
                             f"got {actual[idx].item():.6g}, want {truth[idx].item():.6g}")


FLASH_MULT, FLASH_ATOL = 3, 1e-5


def check_flash_rule(name: str, actual: torch.Tensor, truth: torch.Tensor, pytorch_lp: torch.Tensor):
    """flash-attention's rule (module docstring) over the finite elements; NaN in ``actual`` fails, an infinity
    (an empty state's ``lse``) must equal the truth's. Raises ``AssertionError`` naming the ratio."""
    actual = actual.detach().to(device="cpu", dtype=torch.float64)
    truth = truth.detach().to(device="cpu", dtype=torch.float64)
    pytorch_lp = pytorch_lp.detach().to(device="cpu", dtype=torch.float64)
    if bool(torch.isnan(actual).any()):
        raise AssertionError(f"{name}: NaN elements")
    infinite = torch.isinf(actual) | torch.isinf(truth)
    if not torch.equal(actual[infinite], truth[infinite]):
        raise AssertionError(f"{name}: infinite elements where the truth differs")
    finite = ~infinite
    ours = (actual - truth)[finite].abs().max().item() if bool(finite.any()) else 0.0
    theirs = (pytorch_lp - truth)[finite].abs().max().item() if bool(finite.any()) else 0.0
    if ours > FLASH_MULT * theirs + FLASH_ATOL:
        raise AssertionError(f"{name}: max error {ours:.3g} > {FLASH_MULT} x PyTorch's {theirs:.3g} + {FLASH_ATOL:g} "
                             f"(ratio {ours / max(theirs, 1e-300):.2f})")
