"""The call contract shared by the Triton kernels and their torch reference (plain Python: no Triton needed)."""

from __future__ import annotations


def checked_key_range(key_range: tuple[int, int] | None, num_keys: int, page: int) -> tuple[int, int]:
    """``key_range`` checked against its contract; ``None`` is every key ``[0, num_keys)``."""
    if key_range is None:
        return 0, num_keys
    lo, hi = key_range
    if not (0 <= lo < hi <= num_keys and lo % page == 0 and (hi % page == 0 or hi == num_keys)):
        raise ValueError(
            f"key_range={key_range} is not a page-aligned part of the keys [0, {num_keys}): need lo < hi, lo a "
            f"multiple of the page size {page} and hi one too or equal to q_start + Lq = {num_keys} — split "
            "the keys at page boundaries."
        )
    return lo, hi
