"""``ReadOptions``: how a FOLD read treats its far memory, checked in one place.

``fold.attention`` builds one from its arguments, ``fold.spec_decode``'s policies from their options and
``fold.vllm`` from a drafter's ``fold`` config block; a bad value raises ``TypeError``/``ValueError``
naming the option (:meth:`ReadOptions.check`, for a boundary that names its fields its own way).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from fold.checks import check_choice, check_float, check_int

BACKENDS = ("auto", "torch", "triton")
FAR_POSITIONS = ("shared", "fixed_distance", "none")
# alpha -> infinity is a hard max over the far logits; beyond 1e4 nothing changes at float32
# precision, and alpha * logits would start to overflow.
MAX_ALPHA = 1e4
# how a budgeted read ranks the listed candidate far pages (:func:`fold.far_pages.select_pages`)
RANKS = ("bound", "keys")

_CHECKS = {
    "alpha": lambda x: check_float("alpha", x, 1, MAX_ALPHA),
    "far_position": lambda x: check_choice("far_position", x, FAR_POSITIONS),
    "backend": lambda x: check_choice("backend", x, BACKENDS),
    "far_budget": lambda x: check_int("far_budget", x, 1, none_ok=True,
                                      expected="None (every far entry) or an int >= 1"),
    "far_page": lambda x: check_int("far_page", x, 1, expected="an int >= 1"),
    "far_rank": lambda x: check_choice("far_rank", x, RANKS),
}


@dataclass(frozen=True)
class ReadOptions:
    """The options of a FOLD read (``fold.attention``'s arguments of the same names), checked on creation.

    Args:
        alpha: concentration factor of the far memory, in ``[1, MAX_ALPHA]``. Default: 2.0.
        far_position: one of :data:`FAR_POSITIONS`. Default: ``"shared"``.
        backend: one of :data:`BACKENDS`. Default: ``"auto"``.
        far_budget: None (every far entry) or an int >= 1; ``far_position="shared"`` only. Default: None.
        far_page: entries per far page, >= 1. Default: 64.
        far_rank: how far pages are ranked, one of :data:`RANKS`. Default: ``"bound"``.
    """

    alpha: float = 2.0
    far_position: str = "shared"
    backend: str = "auto"
    far_budget: int | None = None
    far_page: int = 64
    far_rank: str = "bound"

    def __post_init__(self):
        for field in fields(self):
            object.__setattr__(self, field.name, self.check(field.name, getattr(self, field.name)))
        if self.far_budget is not None and self.far_position != "shared":
            raise ValueError(f"far_budget needs far_position='shared' (the far keys' bounds hold at one shared "
                             f"position), got far_position={self.far_position!r}")

    @staticmethod
    def check(name: str, value):
        """The option ``name``'s ``value`` checked (``TypeError``/``ValueError`` naming it) and normalised."""
        return _CHECKS[name](value)

    def check_block(self, n_q: int) -> None:
        """A budget must hold the pages a block of ``n_q`` rows straddles (they are always read)."""
        if self.far_budget is None:
            return
        need = straddled_pages(n_q, self.far_page)
        if self.far_budget // self.far_page < need:
            raise ValueError(f"far_budget must hold at least {need} pages of far_page={self.far_page} entries for a "
                             f"block of {n_q} rows (the pages its rows straddle are always read), i.e. far_budget >= "
                             f"{need * self.far_page}; got far_budget={self.far_budget}")


def straddled_pages(n_q: int, far_page: int) -> int:
    """The most pages of ``far_page`` entries that the far/window edge of a block of ``n_q`` rows can straddle
    (entries far for some row but not every row, or pages that also hold entries that are not far):
    ``ceil((n_q - 1) / P) + 1``. A budgeted read always reads them, so a budget must hold that many pages."""
    return -(-(n_q - 1) // far_page) + 1
