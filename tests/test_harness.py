"""The closeness rule of the checks and tests (a4.course.checks._harness): the tolerance holds for sums taken in any
order, and the comparison still catches a difference just above it."""

from __future__ import annotations

import pytest
import torch

from a4.course.checks._harness import assert_close, compare, randn, tolerance


def one_by_one(terms: torch.Tensor) -> torch.Tensor:
    """terms [m, n, p] added along n one at a time, each addition rounded to float32 (cumsum would add in double)."""
    total = torch.zeros_like(terms[:, 0])
    for i in range(terms.shape[1]):
        total += terms[:, i]
    return total


def products_in_order(a: torch.Tensor, b: torch.Tensor, order: str) -> torch.Tensor:
    """a @ b in float32, each output's n products added in the given order."""
    terms = a[:, :, None] * b[None, :, :]  # [m, n, p], each product rounded once
    if order == "matmul":
        return a @ b
    if order == "forward":
        return one_by_one(terms)
    if order == "backward":
        return one_by_one(terms.flip(1))
    if order == "largest first":
        return one_by_one(terms.gather(1, terms.abs().argsort(dim=1, descending=True)))
    if order == "blocks of 16":
        return one_by_one(terms.unflatten(1, (-1, 16)).sum(dim=2))
    raise ValueError(order)


ORDERS = ["matmul", "forward", "backward", "largest first", "blocks of 16"]


@pytest.mark.parametrize("signs", ["random", "positive"])
@pytest.mark.parametrize("n", [16, 128, 1024, 4096])
def test_float32_tolerance_holds_for_any_order_of_the_sums(n, signs):
    # As in a layer: many outputs, each a sum of n products, measured against the largest output. Positive terms
    # are the worst case of one order: every partial sum grows, and so does every rounding error.
    a, b = randn(32, n, seed=n), randn(n, 24, seed=n + 1)
    if signs == "positive":
        a, b = a.abs(), b.abs()
    exact = a.double() @ b.double()
    results = {order: products_in_order(a, b, order) for order in ORDERS}
    for order, result in results.items():
        assert_close(result, exact, tolerance(torch.float32, n), f"{order} against float64")
    for order, result in results.items():
        assert_close(result, results["matmul"], tolerance(torch.float32, n), f"{order} against matmul")


def test_one_rounding_allows_a_neighbouring_value():
    for dtype in (torch.float32, torch.bfloat16):
        values = (randn(1000, seed=0) * 10).to(dtype)
        # The next value away from zero, for every value: a rounding that went the other way.
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        neighbours = (values.view(bits) + 1).view(dtype)
        assert (neighbours != values).all()
        assert_close(neighbours, values, tolerance(dtype, 0, roundings=1), str(dtype))


def test_compare_catches_a_difference_just_above_the_tolerance():
    expected = randn(8, 8, seed=1)
    allowed = tolerance(torch.float32, 64)
    scale = expected.abs().max().item()
    within, beyond = expected.clone(), expected.clone()
    within[3, 4] += 0.5 * allowed * scale
    beyond[3, 4] += 2 * allowed * scale
    assert compare("within", within, expected, allowed) == []
    assert compare("beyond", beyond, expected, allowed) == [
        f"beyond: max error {2 * allowed * scale:.3g} against values up to {scale:.3g} (allowed: {allowed:.3g} of that)"
    ]


def test_compare_catches_nan_and_a_wrong_shape():
    expected = randn(4, 3, seed=2)
    with_nan = expected.clone()
    with_nan[1, 1] = float("nan")
    assert compare("nan", with_nan, expected, 0.1) != []
    assert compare("shape", expected.T, expected, 0.1) == ["shape: shape (3, 4), expected (4, 3)"]
