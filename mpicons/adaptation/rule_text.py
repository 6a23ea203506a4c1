"""A rule file's text made into plain rule lines before they are parsed: includes, prefixes and the
stacked-or-keyed names, so that a model family states only what is particular to it.

Pure: the files an ``include`` names are read by the caller's :data:`Resolver` (a trainer's built-in
rules folder, or the user's rule file's directory), never here. The lines this gives keep where they
came from (``file:line``), so a bad rule in a shared part is named where it is written.

- ``include NAME`` inlines another file's rules at that point (the first rule that matches decides,
  so rules written before an include take precedence over the included ones).
- ``include NAME SOURCE_PREFIX TARGET_PREFIX`` inlines them under prefixes: a part written once for
  a decoder layer (``self_attention.linear_proj.weight  self_attn.o_proj.weight``) serves every place
  a layer is saved (``decoder.layers.[N]  model.layers.{N}``; torchtitan's ``mtp_layers.{M}``).
- ``include NAME SOURCE_PREFIX TARGET_PREFIX F=EXPRESSION ...`` also gives the part's transforms
  their arguments: each name ``F`` in a chain of the part is that expression (one gated-MLP part
  serves the dense MLP with ``F=intermediate_size`` and the experts with ``F=moe_intermediate_size``).
- ``[N]``, a whole dotted part of a source, means "a stacked axis or one key per index": the rule
  stands for two, ``a.{N}.b`` (one key per layer, ``{N}`` captured) and ``a.b`` with ``unbind(N)``
  put first in its chain (every layer on a leading axis). Several brackets give every combination,
  their unbinds in the order they appear (``[N]`` then ``[E]``: ``[L, E, ...]``).
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..core.errors import InputError

#: ``(name, where) -> (origin, text)``: the file an ``include`` line names (``where``: ``file:line`` of that
#: line, the file's folder being where a relative name is looked for), read by the caller.
Resolver = Callable[[str, str], tuple[str, str]]

_BRACKET = re.compile(r"\[([A-Za-z_]\w*)\]")
_CHAIN_AND_CONDITION = re.compile(r"^(?P<chain>.*?)(?P<condition>\s+if\s+.+)?$")
#: How deep includes may nest (a cycle is refused before this; the bound keeps a mistake cheap).
MAX_DEPTH = 16


@dataclass(frozen=True)
class RuleLine:
    """One line of rules, comment and surplus spaces removed, with the place it was written."""

    where: str  # ``origin:line``
    text: str


def expand(text: str, origin: str, include: Resolver | None = None) -> tuple[RuleLine, ...]:
    """``text`` (the file ``origin``) as plain rule lines: includes inlined, prefixes applied, brackets
    expanded. An :class:`InputError` names the line of a bad include."""
    return tuple(_expand(text, origin, include, _Scope(), (origin,)))


def joined(lines: tuple[RuleLine, ...]) -> str:
    """The expanded lines as one text (what :func:`~mpicons.adaptation.rules.may_read` looks through)."""
    return "\n".join(line.text for line in lines)


@dataclass(frozen=True)
class _Scope:
    """What an include puts a part under: its source and target prefixes, its transforms' arguments."""

    source: str = ""
    target: str = ""
    bindings: tuple[tuple[str, str], ...] = ()


def _expand(text: str, origin: str, include: Resolver | None, scope: _Scope, stack: tuple[str, ...]) -> list[RuleLine]:
    out: list[RuleLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        where = f"{origin}:{number}"
        if not words:
            continue
        if words[0] == "include":
            out += _included(words[1:], where, include, scope, stack)
            continue
        if words[0] == "model_type" and len(stack) > 1:
            raise InputError(f"{where}: model_type belongs to the family's own file, not to a file it includes")
        for line in _prefixed(words, scope, where):
            out += [RuleLine(where, variant) for variant in _variants(line, where)]
    return out


def _included(args: list[str], where: str, include: Resolver | None, scope: _Scope, stack: tuple[str, ...]) -> list[RuleLine]:
    """The rules of the file an ``include`` line names, under its prefixes and arguments joined to the outer ones."""
    positional = [arg for arg in args if "=" not in arg]
    given = [arg.partition("=") for arg in args if "=" in arg]
    if len(positional) not in (1, 3) or any(not re.fullmatch(r"[A-Za-z_]\w*", key) or not value for key, _, value in given):
        raise InputError(
            f"{where}: an include line reads 'include NAME' or 'include NAME SOURCE_PREFIX TARGET_PREFIX [P=EXPRESSION ...]'"
        )
    if include is None:
        raise InputError(f"{where}: include {args[0]!r}: these rules cannot include files (give them as a file)")
    if len(stack) > MAX_DEPTH:
        raise InputError(f"{where}: includes nest more than {MAX_DEPTH} deep")
    origin, text = include(positional[0], where)
    if origin in stack:
        raise InputError(f"{where}: include {positional[0]!r} includes itself ({' -> '.join((*stack, origin))})")
    source, target = (positional[1], positional[2]) if len(positional) == 3 else ("", "")
    bindings = dict(scope.bindings)
    bindings.update({key: _substituted(value, scope.bindings, where) for key, _, value in given})
    inner = _Scope(_join(scope.source, source), _join(scope.target, target), tuple(bindings.items()))
    return _expand(text, origin, include, inner, (*stack, origin))


def _join(outer: str, inner: str) -> str:
    return ".".join(part for part in (outer, inner) if part)


def _prefixed(words: list[str], scope: _Scope, where: str) -> list[str]:
    """A line under an include's scope: a rule's source and target prefixed and its chain's arguments
    given, each pattern of a ``skip`` prefixed."""
    head = words[0]
    if head in ("define", "default", "model_type") or scope == _Scope():
        return [" ".join(words)]
    if head == "skip":
        return [" ".join(["skip", *(_join(scope.source, word) for word in words[1:])])]
    if len(words) < 2:
        raise InputError(f"{where}: expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]', got {' '.join(words)!r}")
    target = words[1] if words[1] == "-" else _join(scope.target, words[1])
    found = _CHAIN_AND_CONDITION.match(" " + " ".join(words[2:]))
    assert found is not None  # the pattern matches any text
    chain = _substituted(found.group("chain").strip(), scope.bindings, where)
    return [" ".join(part for part in (_join(scope.source, head), target, chain) if part) + (found.group("condition") or "")]


def _substituted(chain: str, bindings: tuple[tuple[str, str], ...], where: str) -> str:
    """A chain (or an expression) with each bound name replaced by its expression."""
    if not bindings or not chain:
        return chain
    values = {}
    for key, text in bindings:
        try:
            values[key] = ast.parse(text, mode="eval").body
        except SyntaxError:
            raise InputError(f"{where}: {key}={text!r} is not an expression") from None
    out = []
    for part in calls(chain):
        try:
            out.append(ast.unparse(_Substitute(values).visit(ast.parse(part, mode="eval"))))
        except SyntaxError:
            out.append(part)  # the rule's own check names it
    return " | ".join(out)


class _Substitute(ast.NodeTransformer):
    """Names replaced by expressions (a define's parameters, an include's arguments)."""

    def __init__(self, values: dict[str, ast.expr]) -> None:
        self.values = values

    def visit_Name(self, node: ast.Name) -> ast.expr:
        return self.values.get(node.id, node)


def _variants(line: str, where: str) -> list[str]:
    """A rule whose source holds ``[X]`` parts as the rules it stands for (stacked first); other lines as they are."""
    head, _, rest = line.partition(" ")
    if head in ("define", "default", "model_type", "skip") or "[" not in head:
        if head == "skip" and "[" in rest:
            return [" ".join(["skip", *(v for word in rest.split() for v, _ in _source_forms(word, where))])]
        return [line]
    target, _, tail = rest.partition(" ")
    found = _CHAIN_AND_CONDITION.match(" " + tail)
    assert found is not None  # the pattern matches any text
    chain, condition = found.group("chain").strip(), found.group("condition") or ""
    lines = []
    for source, unbinds in _source_forms(head, where):
        if unbinds and chain.startswith("drop"):
            steps = chain  # a stacked entry left out whole
        else:
            steps = " | ".join([*(f"unbind({name})" for name in unbinds), *([chain] if chain else [])])
        lines.append(" ".join(part for part in (source, target, steps) if part) + condition)
    return lines


def _source_forms(source: str, where: str) -> list[tuple[str, tuple[str, ...]]]:
    """Every form of a source with ``[X]`` parts: each part kept as ``{X}`` or left out (then unbound)."""
    parts = source.split(".")
    marked = [i for i, part in enumerate(parts) if "[" in part or "]" in part]
    for i in marked:
        if _BRACKET.fullmatch(parts[i]) is None:
            raise InputError(f"{where}: {source!r}: '[NAME]' stands alone as a dotted part (decoder.layers.[N].mlp)")
    names = [parts[i][1:-1] for i in marked]
    if len(set(names)) != len(names):
        raise InputError(f"{where}: {source!r}: each [NAME] appears once")
    forms = []
    for stacked in itertools.product((True, False), repeat=len(marked)):
        kept = [p if i not in marked else ("" if stacked[marked.index(i)] else "{" + p[1:-1] + "}") for i, p in enumerate(parts)]
        unbinds = tuple(name for name, is_stacked in zip(names, stacked) if is_stacked)
        forms.append((".".join(p for p in kept if p), unbinds))
    return forms


def calls(text: str) -> list[str]:
    """A chain's calls: ``text`` split at each ``|`` outside parentheses."""
    found, depth, start = [], 0, 0
    for position, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if char == "|" and depth == 0:
            found.append(text[start:position].strip())
            start = position + 1
    return [*found, text[start:].strip()]


@dataclass(frozen=True)
class Define:
    """A named transform chain: its parameters (replaced by a use's arguments) and its chain's text."""

    params: tuple[str, ...]
    chain: str
    where: str


_DEFINE = re.compile(r"^(?P<name>[a-z_]+)\s*(?:\((?P<params>[^()]*)\))?\s*=\s*(?P<chain>.+)$")


class Defines:
    """The ``define`` lines met so far (``define gated(F) = split_rows(groups=1, sizes=(F, F))``): a rule's
    chain names one like a transform (``unbind(N) | gated(intermediate_size)``) and gets its chain, the
    arguments put in place of the parameters. A part included twice may define a name again, alike."""

    def __init__(self, reserved: Iterable[str]) -> None:
        self.reserved = frozenset(reserved)
        self.known: dict[str, Define] = {}

    def add(self, rest: str, where: str) -> str:
        """A ``define`` line (less its first word) recorded; its chain, for the caller to check."""
        found = _DEFINE.match(rest)
        if found is None:
            raise InputError(f"{where}: a define line reads 'define NAME = TRANSFORMS' or 'define NAME(P, ...) = TRANSFORMS'")
        name = found.group("name")
        if name in self.reserved:
            raise InputError(f"{where}: define {name!r}: {name} is a built-in transform")
        params = tuple(p.strip() for p in (found.group("params") or "").split(",") if p.strip())
        if any(not re.fullmatch(r"[A-Za-z_]\w*", p) for p in params) or len(set(params)) != len(params):
            raise InputError(f"{where}: define {name!r}: its parameters are distinct names, as in gated(F)")
        made = Define(params, self.applied(found.group("chain"), where), where)
        earlier = self.known.get(name)
        if earlier is not None and (earlier.params, earlier.chain) != (made.params, made.chain):
            raise InputError(f"{where}: define {name!r} differs from the one at {earlier.where}")
        self.known[name] = made
        return made.chain

    def applied(self, text: str, where: str) -> str:
        """A chain's text with every named chain replaced by its definition."""
        parts = calls(text)
        if not self.known or not all(parts):
            return text
        return " | ".join(self._used(part, where) for part in parts)

    def _used(self, text: str, where: str) -> str:
        try:
            call = ast.parse(text, mode="eval").body
        except SyntaxError:
            return text  # the rule's own check names it
        head = call.func if isinstance(call, ast.Call) else call
        if not isinstance(head, ast.Name) or head.id not in self.known:
            return text
        define = self.known[head.id]
        values = self._arguments(call, head.id, define, where)
        substitute = _Substitute(values)
        return " | ".join(ast.unparse(substitute.visit(ast.parse(part, mode="eval"))) for part in calls(define.chain))

    @staticmethod
    def _arguments(call: ast.expr, name: str, define: Define, where: str) -> dict[str, ast.expr]:
        given = list(call.args) if isinstance(call, ast.Call) else []
        keywords = {k.arg: k.value for k in call.keywords} if isinstance(call, ast.Call) else {}
        values = dict(zip(define.params, given))
        extra = [k for k in keywords if k not in define.params or k in values]
        if len(given) > len(define.params) or extra:
            raise InputError(f"{where}: {name} takes {', '.join(define.params) or 'no arguments'} (defined at {define.where})")
        values.update({k: v for k, v in keywords.items() if k is not None})
        missing = [p for p in define.params if p not in values]
        if missing:
            raise InputError(f"{where}: {name} needs {', '.join(missing)} (defined at {define.where})")
        return values


__all__ = ["MAX_DEPTH", "Define", "Defines", "Resolver", "RuleLine", "calls", "expand", "joined"]
