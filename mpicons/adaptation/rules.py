"""Adapter rule files: how a training framework's state-dict names and layouts become Hugging Face's.

A rule file is text, one rule per line (``#`` starts a comment), read and checked whole before any
work so that a bad rule is one error naming its line. The format is in ``docs/adapter-rules.md``;
each trainer's built-in rules are written in it (``mpicons/trainers/*/rules/``). Pure: parsing and
matching only; what the rules do to pieces is :mod:`mpicons.adaptation.apply`.

Lines::

    model_type llama                      # the config's model_type values this file is for
    default head_dim = hidden_size // num_attention_heads
    skip optimizer.** lr_scheduler.**     # not model state: left out, counted in the report
    SOURCE  TARGET  [TRANSFORM]  [if [not] CONFIG_KEY]

``SOURCE`` is a dotted name with captures: ``{N}`` (digits), ``*`` (within one dotted part), ``**``
(anything). ``TARGET`` uses the captures (``{N}``, ``{N+num_hidden_layers}``) or is ``-`` (no Hugging
Face name, for ``drop``). ``TRANSFORM`` is one call of a small vocabulary (:data:`TRANSFORMS`) whose
arguments are integer expressions over the config's fields, or several joined by ``|``, applied left
to right (``unbind(N) | split_rows(...)``: a stacked layer axis, then a fused tensor of each layer).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..core.errors import InputError
from .rule_text import Defines, Resolver, RuleLine, calls, expand

#: The transforms a rule may name, with their parameters (all integer expressions, but unbind's capture name).
TRANSFORMS: dict[str, tuple[str, ...]] = {
    "unbind": ("index",),  # one output per index of dim 0, the index in the target's capture ``{index}``
    "rope_to_half": ("heads", "head_dim"),  # rows of each head from interleaved rotary pairs to half-split order
    "rope_to_interleaved": ("heads", "head_dim"),  # the inverse: half-split rows to interleaved pairs
    "split_rows": ("groups", "sizes"),  # a fused tensor cut along dim 0 into parts, group by group
    "crop_rows": ("rows",),  # the first rows of dim 0 only (a padded vocabulary)
    "drop": ("same_as",),  # a model entry the conversion leaves out on purpose (reported); same_as optional
}
#: Arguments that name a saved tensor (a dotted name, not an expression) and may be left out:
#: ``drop(same_as=tok_embeddings.weight)`` says the entry repeats that tensor (a tied ``lm_head``).
NAME_ARGS = {("drop", "same_as")}

_CAPTURE = re.compile(r"\{([A-Za-z_]\w*)\}")
_TARGET_FIELD = re.compile(r"\{([A-Za-z_]\w*)(?:\s*\+\s*([^{}]+))?\}")
_NAME_PART = re.compile(r"[A-Za-z0-9_\-]+")
_CALL = r"[a-z_]+(?:\(.*\))?"
_RULE = re.compile(
    rf"^(?P<source>\S+)\s+(?P<target>\S+)(?:\s+(?P<transform>{_CALL}(?:\s*\|\s*{_CALL})*))?(?:\s+if\s+(?P<cond>.+))?$"
)
_CONDITION = re.compile(r"^(?P<negated>not\s+)?(?P<key>[A-Za-z_][\w.]*)$")
_ALLOWED_NODES = (
    ast.Expression, ast.BinOp, ast.Constant, ast.Name, ast.Attribute, ast.Load, ast.Add, ast.Sub, ast.Mult,
    ast.FloorDiv, ast.Tuple, ast.List, ast.UnaryOp, ast.USub,
)  # fmt: skip
#: Transforms that end a chain: their outputs differ in shape (split_rows) or are a view (rotary orders).
LAST_ONLY = ("split_rows", "rope_to_half", "rope_to_interleaved")


@dataclass(frozen=True)
class Transform:
    """A transform named by a rule: its kind and its arguments as unevaluated expressions."""

    kind: str = "rename"
    args: Mapping[str, ast.expr] = field(default_factory=dict)

    def value(self, name: str, config: Mapping[str, object], where: str) -> int | tuple[int, ...]:
        """An argument evaluated against the config (a tuple for ``sizes``)."""
        return evaluate(self.args[name], config, where)

    def name_arg(self, name: str) -> str | None:
        """An argument that names a saved tensor (:data:`NAME_ARGS`), None when not given."""
        node = self.args.get(name)
        return None if node is None else ast.unparse(node)


@dataclass(frozen=True)
class Rule:
    """One line: a source pattern, its target template, a transform and a condition on the config."""

    line: int
    source: str
    target: str | None  # None: ``-`` (dropped without a Hugging Face name)
    steps: tuple[Transform, ...]  # applied left to right; empty: a rename
    pattern: re.Pattern[str]
    condition: str | None = None  # a config key; the rule applies when it is truthy
    negated: bool = False  # ... or, with ``if not``, when it is falsy
    skip: bool = False  # a ``skip`` line: not model state
    where: str = ""  # ``file:line`` where it is written (an included part's own file)

    @property
    def kind(self) -> str:
        """The transform as the report names it: ``rename``, ``drop``, ``unbind | split_rows``, ..."""
        return " | ".join(step.kind for step in self.steps) or "rename"

    @property
    def unbound(self) -> tuple[str, ...]:
        """The target's fields the rule's ``unbind`` steps fill, in order."""
        return tuple(getattr(s.args["index"], "id", "") for s in self.steps if s.kind == "unbind")

    def applies(self, config: Mapping[str, object]) -> bool:
        if self.condition is None:
            return True
        return bool(lookup(config, self.condition, None)) != self.negated


@dataclass(frozen=True)
class RuleSet:
    """A rule file, parsed and checked: its rules in order (the first that matches a name decides)."""

    origin: str  # the file's path, or the built-in adapter's name
    rules: tuple[Rule, ...]
    model_types: tuple[str, ...] = ()  # empty: any
    defaults: Mapping[str, ast.expr] = field(default_factory=dict)
    #: Whether the rules read the config (a name in an argument, a condition, target arithmetic or a default).
    reads_config: bool = False

    def where(self, rule: Rule) -> str:
        return rule.where or f"{self.origin}:{rule.line}"

    def config_with_defaults(self, config: Mapping[str, object]) -> dict[str, object]:
        """The config with the file's ``default`` lines filled in where the config lacks the key (or holds null)."""
        merged = dict(config)
        for key, expression in self.defaults.items():
            if merged.get(key) is None:
                merged[key] = evaluate(expression, merged, f"{self.origin}: default {key}")
        return merged

    def match(self, name: str, config: Mapping[str, object]) -> tuple[Rule, dict[str, str]] | None:
        """The first rule whose pattern matches ``name`` and whose condition holds, with its captures."""
        for rule in self.rules:
            found = rule.pattern.fullmatch(name)
            if found is not None and rule.applies(config):
                return rule, found.groupdict()
        return None


def lookup(config: Mapping[str, object], key: str, default: object = KeyError) -> object:
    """``config[key]``, with dots reaching into nested objects (``text_config.num_attention_heads``)."""
    value: object = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            if default is KeyError:
                raise KeyError(key)
            return default
        value = value[part]
    return value


def evaluate(node: ast.expr | ast.Expression, config: Mapping[str, object], where: str) -> int | tuple[int, ...]:
    """An integer expression over config fields: numbers, names, ``+ - * //``, tuples; nothing else runs."""

    def value(n: ast.AST) -> int | tuple[int, ...]:
        if isinstance(n, ast.Expression):
            return value(n.body)
        if isinstance(n, ast.Constant) and type(n.value) is int:
            return n.value
        if isinstance(n, (ast.Name, ast.Attribute)):
            key = ast.unparse(n)
            try:
                found = lookup(config, key)
            except KeyError:
                raise InputError(f"{where}: the config has no {key!r} (add it to config.json or a 'default' line)") from None
            if type(found) is not int:
                raise InputError(f"{where}: config {key!r} is {found!r}, not a whole number")
            return found
        if isinstance(n, (ast.Tuple, ast.List)):
            items = [value(e) for e in n.elts]
            if any(isinstance(i, tuple) for i in items):
                raise InputError(f"{where}: nested lists are not allowed")
            return tuple(i for i in items if isinstance(i, int))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            inner = value(n.operand)
            if isinstance(inner, tuple):
                raise InputError(f"{where}: '-' of a list")
            return -inner
        if isinstance(n, ast.BinOp):
            left, right = value(n.left), value(n.right)
            if isinstance(left, tuple) or isinstance(right, tuple):
                raise InputError(f"{where}: arithmetic on a list")
            if isinstance(n.op, ast.Add):
                return left + right
            if isinstance(n.op, ast.Sub):
                return left - right
            if isinstance(n.op, ast.Mult):
                return left * right
            if isinstance(n.op, ast.FloorDiv):
                if right == 0:
                    raise InputError(f"{where}: division by zero")
                return left // right
        raise InputError(f"{where}: {ast.unparse(n)!r} is not an integer expression over config fields")

    return value(node)


def evaluate_text(text: str, config: Mapping[str, object], where: str) -> int | tuple[int, ...]:
    """An expression written in a rule (a target's ``{N + num_hidden_layers}``), evaluated against the config."""
    return evaluate(_expression(text, where), config, where)


def _expression(text: str, where: str) -> ast.expr:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise InputError(f"{where}: {text.strip()!r} is not an expression") from None
    if not _plain(tree):
        raise InputError(f"{where}: {text.strip()!r}: only whole numbers, config fields, + - * // and lists are allowed")
    return tree.body


def _plain(node: ast.AST) -> bool:
    """Only whole numbers and dotted config names (no attribute of anything else, no strings or floats)."""
    for n in ast.walk(node):
        if not isinstance(n, _ALLOWED_NODES):
            return False
        if isinstance(n, ast.Constant) and type(n.value) is not int:
            return False
        if isinstance(n, ast.Attribute) and not isinstance(n.value, (ast.Name, ast.Attribute)):
            return False
    return True


def _dotted(node: ast.AST) -> bool:
    """A plain dotted name (``tok_embeddings.weight``): names joined by dots, nothing else."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _names_config(node: ast.AST) -> bool:
    """Whether an expression reads a config field (a name), rather than numbers only."""
    return any(isinstance(n, (ast.Name, ast.Attribute)) for n in ast.walk(node))


def _pattern(source: str, where: str) -> re.Pattern[str]:
    """A source pattern as a regular expression: ``{X}`` digits (named X), ``*`` one dotted part, ``**`` anything."""
    parts, names, position = [], set(), 0
    for token in re.finditer(r"\{[^{}]*\}|\*\*|\*", source):
        literal = source[position : token.start()]
        if literal and not all(_NAME_PART.fullmatch(p) or p == "" for p in literal.split(".")):
            raise InputError(f"{where}: {source!r}: names are dotted parts of letters, digits, '_' and '-'")
        parts.append(re.escape(literal))
        text = token.group()
        if text == "**":
            parts.append(".+")
        elif text == "*":
            parts.append("[^.]+")
        else:
            capture = _CAPTURE.fullmatch(text)
            if capture is None:
                raise InputError(f"{where}: {text!r} in {source!r}: a capture is {{NAME}}, NAME a word")
            if capture.group(1) in names:
                raise InputError(f"{where}: capture {text} appears twice in {source!r}")
            names.add(capture.group(1))
            parts.append(f"(?P<{capture.group(1)}>[0-9]+)")
        position = token.end()
    literal = source[position:]
    if literal and not all(_NAME_PART.fullmatch(p) or p == "" for p in literal.split(".")):
        raise InputError(f"{where}: {source!r}: names are dotted parts of letters, digits, '_' and '-'")
    parts.append(re.escape(literal))
    return re.compile("".join(parts))


def _transforms(text: str | None, where: str) -> tuple[Transform, ...]:
    """A rule's transform chain, checked: ``drop`` stands alone; split_rows and the rotary orders end it."""
    if text is None:
        return ()
    parts = calls(text)
    if not all(parts):
        raise InputError(f"{where}: {text!r}: a '|' joins two transforms, and one of them is missing")
    steps = tuple(_transform(call, where) for call in parts)
    kinds = [step.kind for step in steps]
    if len(steps) > 1 and "drop" in kinds:
        raise InputError(f"{where}: drop leaves the tensor out: it takes no other transform")
    for kind in kinds[:-1]:
        if kind in LAST_ONLY:
            raise InputError(
                f"{where}: {kind} must be the last transform of a chain ({' | '.join(kinds)}): "
                f"unbind and crop_rows come before it"
            )
    return steps


def _transform(text: str, where: str) -> Transform:
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError:
        raise InputError(f"{where}: {text!r} is not a transform call like unbind(E)") from None
    if isinstance(call, ast.Name):
        call = ast.Call(func=call, args=[], keywords=[])
    if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
        raise InputError(f"{where}: {text!r} is not a transform call like unbind(E)")
    kind = call.func.id
    if kind not in TRANSFORMS:
        raise InputError(f"{where}: unknown transform {kind!r} (known: {', '.join(TRANSFORMS)})")
    params = TRANSFORMS[kind]
    if len(call.args) > len(params):
        raise InputError(f"{where}: {kind} takes {len(params)} argument(s): {', '.join(params) or 'none'}")
    args: dict[str, ast.expr] = dict(zip(params, call.args))
    for keyword in call.keywords:
        if keyword.arg not in params or keyword.arg in args:
            raise InputError(f"{where}: {kind}: unexpected or repeated argument {keyword.arg!r} (takes {', '.join(params)})")
        args[keyword.arg] = keyword.value
    missing = [p for p in params if p not in args and (kind, p) not in NAME_ARGS]
    if missing:
        raise InputError(f"{where}: {kind} needs {', '.join(missing)}")
    for name, node in args.items():
        if (kind, name) in NAME_ARGS:
            if not _dotted(node):
                raise InputError(
                    f"{where}: {kind}({name}={ast.unparse(node)}): {name} is the saved tensor's dotted name, "
                    "as in drop(same_as=tok_embeddings.weight)"
                )
            continue
        if kind == "unbind":
            if not isinstance(node, ast.Name):
                raise InputError(f"{where}: unbind's argument is the target's capture name, as in unbind(E)")
            continue
        if not _plain(node):
            raise InputError(
                f"{where}: {kind} {name}={ast.unparse(node)!r}: only whole numbers, config fields, + - * // and lists"
            )
    return Transform(kind, args)


def _check_target(rule: Rule, captures: set[str], where: str) -> None:
    kinds = [step.kind for step in rule.steps]
    if rule.target is None:
        if kinds != ["drop"]:
            raise InputError(f"{where}: target '-' (no Hugging Face name) goes only with drop")
        return
    unbound = rule.unbound
    fields = {found.group(1) for found in _TARGET_FIELD.finditer(rule.target)}
    for index in unbound:
        if index not in fields:
            raise InputError(f"{where}: unbind({index}) makes one tensor per index: the target must hold {{{index}}}")
        if index in captures:
            raise InputError(f"{where}: unbind({index}): {{{index}}} is already a capture of the source")
        if unbound.count(index) > 1:
            raise InputError(f"{where}: unbind({index}) appears twice: each unbind fills its own {{NAME}}")
    if "split_rows" in kinds:
        alternatives = re.findall(r"\{([^{}]*\|[^{}]*)\}", rule.target)
        if len(alternatives) != 1:
            raise InputError(f"{where}: split_rows names its parts in the target, once, as in {{q|k|v}}")
    for found in _TARGET_FIELD.finditer(rule.target):
        name, offset = found.group(1), found.group(2)
        if name not in captures and name not in unbound:
            raise InputError(f"{where}: target {rule.target!r} uses {{{name}}}, which the source does not capture")
        if offset is not None:
            _expression(offset, where)
    leftover = _TARGET_FIELD.sub("x", re.sub(r"\{[^{}]*\|[^{}]*\}", "x", rule.target))
    if "{" in leftover or "}" in leftover or not all(_NAME_PART.fullmatch(p) for p in leftover.split(".")):
        raise InputError(f"{where}: target {rule.target!r}: dotted parts of letters, digits, '_', '-' and {{captures}}")


_WILDCARD = re.compile(r"\{[^{}]*\}|\*")


def _may_match(word: str, name: str) -> bool:
    """Whether ``word``, read as a source pattern, may match ``name``: its literal parts (between
    captures and ``*``) found in ``name`` in order, the first at its start and the last at its end."""
    parts = _WILDCARD.split(word)
    if len(parts) == 1:
        return word == name
    first, last = parts[0], parts[-1]
    if len(first) + len(last) > len(name) or not name.startswith(first) or not name.endswith(last):
        return False
    position, end = len(first), len(name) - len(last)
    for middle in parts[1:-1]:
        position = name.find(middle, position, end)
        if position < 0:
            return False
        position += len(middle)
    return True


def may_read(text: str, name: str) -> bool:
    """Whether a rule file's ``text`` may hold a source pattern matching ``name``, told without compiling
    its patterns: a line's first word (a rule's source), or a word of a ``skip`` line, whose literal
    parts ``name`` holds in order. A file this says no to reads no ``name``; a yes is only a maybe."""
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        sources = words[1:] if words[:1] == ["skip"] else words[:1]
        if any(_may_match(word, name) for word in sources):
            return True
    return False


def parse_rules(text: str, origin: str, include: Resolver | None = None) -> RuleSet:
    """A rule file's text checked whole: the first bad line is an :class:`InputError` naming ``file:line``.
    ``include`` reads the files its ``include`` lines name (:mod:`mpicons.adaptation.rule_text`)."""
    return parse_lines(expand(text, origin, include), origin)


def parse_lines(lines: tuple[RuleLine, ...], origin: str) -> RuleSet:
    """Expanded rule lines (:func:`~mpicons.adaptation.rule_text.expand`) checked whole, as :func:`parse_rules`."""
    rules: list[Rule] = []
    model_types: list[str] = []
    defaults: dict[str, ast.expr] = {}
    defines = Defines(TRANSFORMS)
    reads_config = False
    for entry in lines:
        line, where = entry.text, entry.where
        number = int(where.rpartition(":")[2])
        word, _, rest = line.partition(" ")
        rest = rest.strip()
        if word == "model_type":
            if not rest:
                raise InputError(f"{where}: model_type needs at least one value")
            model_types += rest.split()
            continue
        if word == "define":
            _transforms(defines.add(rest, where), where)  # checked as a rule's chain, its parameters as numbers
            continue
        if word == "default":
            key, equals, expression = rest.partition("=")
            if not equals or not re.fullmatch(r"[A-Za-z_][\w.]*", key.strip()):
                raise InputError(f"{where}: a default line reads 'default KEY = EXPRESSION'")
            parsed = _expression(expression, where)
            if key.strip() in defaults and ast.dump(defaults[key.strip()]) != ast.dump(parsed):
                raise InputError(f"{where}: a second, different default for {key.strip()!r}")
            defaults[key.strip()] = parsed
            reads_config = True
            continue
        if word == "skip":
            if not rest:
                raise InputError(f"{where}: skip needs at least one pattern")
            for source in rest.split():
                rules.append(Rule(number, source, None, (), _pattern(source, where), skip=True, where=where))
            continue
        rule = _rule(line, number, where, defines)
        reads_config = reads_config or _reads_config(rule, where)
        rules.append(rule)
    if not rules:
        raise InputError(f"{origin}: no rules")
    return RuleSet(origin, tuple(rules), tuple(model_types), defaults, reads_config)


def _rule(line: str, number: int, where: str, defines: Defines) -> Rule:
    """One rule line, named transforms replaced by their definitions, checked."""
    found = _RULE.match(line)
    if found is None:
        raise InputError(f"{where}: expected 'SOURCE TARGET [TRANSFORM] [if [not] KEY]', got {line!r}")
    condition, negated = None, False
    if found.group("cond") is not None:
        cond = _CONDITION.match(found.group("cond").strip())
        if cond is None:
            raise InputError(f"{where}: a condition reads 'if KEY' or 'if not KEY' (KEY a config field)")
        condition, negated = cond.group("key"), cond.group("negated") is not None
    source, target = found.group("source"), found.group("target")
    pattern = _pattern(source, where)
    chain = found.group("transform")
    steps = _transforms(None if chain is None else defines.applied(chain, where), where)
    rule = Rule(number, source, None if target == "-" else target, steps, pattern, condition, negated, where=where)
    _check_target(rule, set(pattern.groupindex), where)
    return rule


def _reads_config(rule: Rule, where: str) -> bool:
    """Whether a rule reads the config: a condition, a config field in an argument, or target arithmetic over one."""
    if rule.condition is not None:
        return True
    if any(
        step.kind != "unbind" and any(_names_config(node) for arg, node in step.args.items() if (step.kind, arg) not in NAME_ARGS)
        for step in rule.steps
    ):
        return True
    return any(
        found.group(2) and _names_config(_expression(found.group(2), where))
        for found in _TARGET_FIELD.finditer(rule.target or "")
    )


def choose_rules(adapter: str, config: Mapping[str, object] | None, text: str, include: Resolver | None = None) -> RuleSet:
    """The rule set of a rule file (``adapter``: its path, ``text``: what the caller read), checked against
    the model's config: a file that reads the config needs one, and one written for other model types
    refuses it. (A trainer's built-in rules are chosen by its leaf, :mod:`mpicons.trainers`.)"""
    rule_set = parse_rules(text, adapter, include)
    if rule_set.reads_config and config is None:
        raise InputError(f"{adapter}: its rules read the model's config: give --hf-assets DIR (with config.json)")
    model_type = None if config is None else config.get("model_type")
    if rule_set.model_types and model_type is not None and model_type not in rule_set.model_types:
        raise InputError(
            f"{adapter}: written for model_type {', '.join(rule_set.model_types)}, but config.json says {model_type!r}"
        )
    return rule_set


def target_names(rule: Rule, captures: Mapping[str, str], config: Mapping[str, object], where: str) -> list[str]:
    """The target with the captures filled in (arithmetic evaluated); one name per ``{a|b}`` alternative."""
    assert rule.target is not None

    def fill(found: re.Match[str]) -> str:
        name, offset = found.group(1), found.group(2)
        if name not in captures:
            return found.group(0)  # unbind's index, filled per index
        value = int(captures[name])
        if offset is not None:
            extra = evaluate(_expression(offset, where), config, where)
            if isinstance(extra, tuple):
                raise InputError(f"{where}: {offset!r} is a list, not a number")
            value += extra
        return str(value)

    filled = _TARGET_FIELD.sub(fill, rule.target)
    alternatives = re.search(r"\{([^{}]*\|[^{}]*)\}", filled)
    if alternatives is None:
        return [filled]
    return [filled[: alternatives.start()] + part + filled[alternatives.end() :] for part in alternatives.group(1).split("|")]


__all__ = [
    "TRANSFORMS",
    "NAME_ARGS",
    "Transform",
    "Rule",
    "RuleSet",
    "parse_rules",
    "parse_lines",
    "may_read",
    "choose_rules",
    "target_names",
    "evaluate",
    "evaluate_text",
    "lookup",
]
