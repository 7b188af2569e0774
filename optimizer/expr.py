"""Integer index expressions of a loop nest, as data: loop variables, constants, sums, and products,
quotients and remainders by constants.

Why data and not target text: fusion, the cost model's features and every renderer read the same
offsets (a load's stride along the innermost loop, whether a merged loop's index is still divided,
whether two accesses are the same element); each renderer prints them in its own syntax.
Division is floor division of non-negative values (every index is), which C's `/` and Triton's
`//` agree on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence


class Expr:
    """An index expression; build them with `var`, `const`, `mul`, `add` and `Div`/`Mod`."""

    def children(self) -> tuple[Expr, ...]:
        return ()

    def walk(self) -> Iterator[Expr]:
        yield self
        for c in self.children():
            yield from c.walk()

    def names(self) -> set[str]:
        """The loop variables it reads."""
        return {x.name for x in self.walk() if isinstance(x, Var)}


@dataclass(frozen=True)
class Var(Expr):
    name: str


@dataclass(frozen=True)
class Const(Expr):
    value: int


@dataclass(frozen=True)
class Sum(Expr):
    terms: tuple[Expr, ...]          # two or more, none of them 0

    def children(self) -> tuple[Expr, ...]:
        return self.terms


@dataclass(frozen=True)
class Mul(Expr):
    e: Expr
    k: int

    def children(self) -> tuple[Expr, ...]:
        return (self.e,)


@dataclass(frozen=True)
class Div(Expr):
    e: Expr
    d: int

    def children(self) -> tuple[Expr, ...]:
        return (self.e,)


@dataclass(frozen=True)
class Mod(Expr):
    e: Expr
    n: int

    def children(self) -> tuple[Expr, ...]:
        return (self.e,)


ZERO = Const(0)


def var(name: str) -> Var:
    return Var(name)


def const(value: int) -> Const:
    return Const(int(value))


def mul(e: Expr, k: int) -> Expr:
    if k == 0 or e == ZERO:
        return ZERO
    return e if k == 1 else Mul(e, k)


def add(terms: Sequence[Expr]) -> Expr:
    terms = [t for t in terms if t != ZERO]
    if not terms:
        return ZERO
    return terms[0] if len(terms) == 1 else Sum(tuple(terms))


def evaluate(e: Expr, env: Mapping[str, int] | Callable[[str], int]) -> int:
    """The value of `e` with its variables from `env` (a mapping, or a function of the name)."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env(e.name) if callable(env) else env[e.name]
    if isinstance(e, Sum):
        return sum(evaluate(t, env) for t in e.terms)
    if isinstance(e, Mul):
        return evaluate(e.e, env) * e.k
    if isinstance(e, Div):
        return evaluate(e.e, env) // e.d
    if isinstance(e, Mod):
        return evaluate(e.e, env) % e.n
    raise TypeError(f"not an index expression: {e!r}")


def stride_along(e: Expr, name: str) -> int:
    """How far one step of loop variable `name` moves `e` from the origin (every other variable 0)."""
    return evaluate(e, lambda v: 1 if v == name else 0) - evaluate(e, lambda v: 0)


def is_constant(e: Expr) -> bool:
    return isinstance(e, Const)


def divides(e: Expr, names: set[str]) -> bool:
    """Whether `e` divides, or takes a remainder of, one of the variables `names` itself."""
    return any(isinstance(x, (Div, Mod)) and isinstance(x.e, Var) and x.e.name in names for x in e.walk())


def render(e: Expr, mul: Callable[[str, int], str], div: Callable[[str, int], str],
           mod: Callable[[str, int], str]) -> str:
    """`e` as text: variables by name, sums as "(a + b)", and products, quotients and remainders by
    constants spelled by the target's `mul`, `div` and `mod` (each given its operand's text)."""
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        return str(e.value)
    if isinstance(e, Sum):
        return "(" + " + ".join(render(t, mul, div, mod) for t in e.terms) + ")"
    spell, k = {Mul: (mul, "k"), Div: (div, "d"), Mod: (mod, "n")}[type(e)]
    return spell(render(e.children()[0], mul, div, mod), getattr(e, k))


def _split(e: Expr) -> tuple[Expr, int, int | None] | None:
    """(L, D, n) when `e` is (L / D) % n as a reshape's index map makes it (D = 1: L % n; n = None:
    the outermost L / D, whose L holds no remainder), else None."""
    if isinstance(e, Mod):
        if isinstance(e.e, Div):
            return e.e.e, e.e.d, e.n
        return e.e, 1, e.n
    if isinstance(e, Div) and not any(isinstance(x, Mod) for x in e.e.walk()):
        return e.e, e.d, None
    return None


def fold_splits(terms: Sequence[tuple[Expr, int]]) -> list[tuple[Expr, int]]:
    """Index terms (index, stride) with the divisions of a reshape undone where the strides allow:
    `(L/D)%n * s + (L/(D*n)) * (s*n)` is `(L/D) * s`. A [B, T, C] tensor read as [B*T, C] is then
    `i0*C` again, not `(i0/T)*(T*C) + (i0%T)*C`: two divisions less per element (per row in a
    column reduction, which ran 2 ms for a [1392, 768] bias gradient). The terms that are pieces
    of a split come after the others, in the order they came."""
    parts: list[list] = []
    rest: list[tuple[Expr, int]] = []
    first: dict[Expr, int] = {}
    for e, stride in terms:
        form = _split(e)
        if form is None:
            rest.append((e, stride))
        else:
            first.setdefault(form[0], len(first))
            parts.append([*form, stride, len(parts)])
    # a run's pieces of one L, by increasing D, each one's D the previous one's D * n: one pass
    kept: list[list] = []
    for part in sorted(parts, key=lambda p: (first[p[0]], p[1])):
        last = kept[-1] if kept else None
        if last and last[0] == part[0] and last[2] is not None and part[1] == last[1] * last[2] \
                and part[3] == last[3] * last[2]:
            last[2] = None if part[2] is None else last[2] * part[2]
        else:
            kept.append(part)
    for L, D, n, stride, _ in sorted(kept, key=lambda p: p[4]):        # in the order they came
        e = L if D == 1 else Div(L, D)
        rest.append((e if n is None else Mod(e, n), stride))
    return rest


def offset(idx: Sequence[Expr], strides: Sequence[int], shape: Sequence[int]) -> Expr:
    """The element offset of index `idx` into a tensor of this shape and these strides."""
    return add([mul(e, s) for e, s in fold_splits([(e, s) for e, s, n in zip(idx, strides, shape) if n != 1])])
