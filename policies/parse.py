"""Policy parsing: YAML text → validated :class:`~policies.model.PolicyModel`, or a PolicyError.

Pure (bytes and mappings in, a model or an error out). Three layers, each reporting
``path: message`` lines:

1. YAML syntax (``safe_load`` semantics, plus duplicate keys are errors) with line and column;
2. the schema in :mod:`policies.model` — pydantic's errors are rewritten here so the path reads
   ``rules[2].ratio`` and the message says what was expected and what was found;
3. cross-field rules the schema cannot express: backend references, unique rule names, the
   primary never being a shadow leg, credential headers.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from core.quality import DEFAULT_MARGINS
from policies.errors import PolicyError
from policies.headers import is_credential, is_gateway_owned
from policies.model import Leg, PolicyModel, Rollout

MAX_REPORTED_PROBLEMS = 20
_PLAIN_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_MERGE_TAG = "tag:yaml.org,2002:merge"


def read_yaml(data: bytes | str, *, source: str) -> Mapping[str, object]:
    """Parse policy YAML to a mapping; syntax errors and duplicate keys raise PolicyError."""
    try:
        raw = yaml.load(
            data, Loader=_StrictLoader
        )  # _StrictLoader is a SafeLoader: safe_load semantics
    except yaml.MarkedYAMLError as exc:
        raise PolicyError(_yaml_problem(exc), source=source) from None
    except yaml.YAMLError as exc:
        raise PolicyError(f"(yaml): {exc}", source=source) from None
    if raw is None:
        raise PolicyError(
            "(top level): the policy is empty; it needs at least 'version: 1'", source=source
        )
    if not isinstance(raw, Mapping):
        raise PolicyError(f"(top level): must be a mapping, got {_show(raw)}", source=source)
    return raw


def validate_policy(raw: Mapping[str, object], *, source: str) -> PolicyModel:
    """Validate a mapping against the schema and the cross-field rules."""
    try:
        model = PolicyModel.model_validate(raw)
    except ValidationError as exc:
        raise PolicyError(_limit([_problem(e) for e in exc.errors()]), source=source) from None
    problems = reference_problems(model)
    if problems:
        raise PolicyError(_limit(problems), source=source)
    return model


def reference_problems(model: PolicyModel) -> list[str]:
    """Cross-field problems of a schema-valid policy, as ``path: message`` lines."""
    problems: list[str] = []
    if model.primary is not None and model.primary not in model.backends:
        problems.append(f"primary: unknown backend {model.primary!r} ({_known(model)})")
    first_index: dict[str, int] = {}
    for i, rule in enumerate(model.rules):
        if rule.name == "default":
            problems.append(f"rules[{i}].name: 'default' is reserved for the default rule")
        elif rule.name in first_index:
            problems.append(
                f"rules[{i}].name: duplicate rule name {rule.name!r} "
                f"(first used by rules[{first_index[rule.name]}])"
            )
        else:
            first_index[rule.name] = i
        problems.extend(_leg_problems(f"rules[{i}]", rule.legs, model))
        problems.extend(
            _rollout_problems(f"rules[{i}]", rule.rollout, rule.legs, model, rule.ratio)
        )
    if model.default is not None:
        problems.extend(_leg_problems("default", model.default.legs, model))
        problems.extend(
            _rollout_problems(
                "default", model.default.rollout, model.default.legs, model, model.default.ratio
            )
        )
    problems.extend(_counterfactual_problems(model))
    problems.extend(_quality_problems(model))
    for j, name in enumerate(model.headers.allow):
        if is_gateway_owned(name):
            problems.append(
                f"headers.allow[{j}]: {name!r} is set by the gateway or is connection-level; "
                "it is never copied from the client"
            )
        elif is_credential(name) and not model.headers.allow_credentials_to_shadows:
            problems.append(
                f"headers.allow[{j}]: {name!r} may carry client credentials; set "
                "headers.allow_credentials_to_shadows: true to forward it to shadows"
            )
    return problems


def _rollout_problems(
    where: str,
    rollout: Rollout | None,
    legs: Sequence[Leg],
    model: PolicyModel,
    ratio: float | str,
) -> list[str]:
    """A rollout needs a primary to fall back to, exactly one candidate leg to serve, and quality
    guards that can work on the traffic it gets: at least one of them on, and a reference for
    the candidate's answers — a baseline leg, or the primary's own answer mirrored behind a
    canary answer, which needs a ``ratio`` above 0 (at ``live`` the primary is mirrored at
    ``reference_ratio``, never 0)."""
    if rollout is None:
        return []
    path = f"{where}.rollout"
    problems = []
    if model.primary is None:
        problems.append(f"{path}: a rollout needs 'primary:' (the backend it falls back to)")
    candidates = [leg.backend for leg in legs if leg.role == "candidate"]
    if rollout.candidate is not None:
        if rollout.candidate not in candidates:
            problems.append(
                f"{path}.candidate: {rollout.candidate!r} is not a candidate leg of this rule "
                f"(candidate legs: {', '.join(candidates) or 'none'})"
            )
    elif len(candidates) != 1:
        problems.append(
            f"{path}: the rule has {len(candidates)} candidate legs; name the one that serves "
            f"with rollout.candidate ({', '.join(candidates) or 'add a candidate leg'})"
        )
    g = rollout.guards
    if g.divergence_rate_max is None and g.sampled_divergence_max is None:
        problems.append(
            f"{path}.guards: no quality guard is on: a candidate must be judged on what it says "
            "(set divergence_rate_max for greedy traffic and sampled_divergence_max for sampled)"
        )
    has_baseline = any(leg.role == "baseline" for leg in legs)
    if not has_baseline and ratio == 0:
        problems.append(
            f"{where}.ratio: 0 mirrors nothing, so no canary answer has the primary's answer "
            "behind it, and the rule has no baseline leg: its quality guards would have no "
            "reference (set a ratio above 0 or add a baseline leg)"
        )
    if g.sampled_divergence_max is not None and model.shaping.override_temperature is not None:
        problems.append(
            "shaping.override_temperature: mirrored legs would sample at another temperature than "
            f"the candidate's canary answers, so {path}.guards.sampled_divergence_max would judge "
            "two distributions that differ by construction (unset it, or turn that guard off)"
        )
    return problems


def _counterfactual_problems(model: PolicyModel) -> list[str]:
    c = model.counterfactual
    if c is None:
        return []
    problems: list[str] = []
    for path, name in [
        ("counterfactual.tokenizer", c.tokenizer),
        *((f"counterfactual.drafters[{i}]", d) for i, d in enumerate(c.drafters)),
    ]:
        if name not in model.backends:
            problems.append(f"{path}: unknown backend {name!r} ({_known(model)})")
        elif name == model.primary:
            problems.append(
                f"{path}: {name!r} is the primary; counterfactual calls never go to the primary"
            )
    return problems


def _quality_problems(model: PolicyModel) -> list[str]:
    q = model.quality
    problems = [
        f"quality.margins.{name}: unknown metric (known: {', '.join(sorted(DEFAULT_MARGINS))})"
        for name in q.margins
        if name not in DEFAULT_MARGINS
    ]
    lk = q.likelihood
    if lk is not None and lk.scorer is not None:
        if lk.scorer not in model.backends:
            problems.append(
                f"quality.likelihood.scorer: unknown backend {lk.scorer!r} ({_known(model)})"
            )
        elif lk.scorer == model.primary:
            problems.append(
                f"quality.likelihood.scorer: {lk.scorer!r} is the primary; "
                "scoring calls never go to the primary"
            )
    return problems


def _leg_problems(where: str, legs: Sequence[Leg], model: PolicyModel) -> list[str]:
    problems: list[str] = []
    seen: dict[tuple[str, str, str | None], int] = {}
    for k, leg in enumerate(legs):
        path = f"{where}.legs[{k}]"
        if leg.backend not in model.backends:
            problems.append(f"{path}.backend: unknown backend {leg.backend!r} ({_known(model)})")
        elif leg.backend == model.primary:
            problems.append(
                f"{path}.backend: {leg.backend!r} is the primary; shadow legs must target "
                "other backends"
            )
        ident = (leg.backend, leg.role, leg.model)
        if ident in seen:
            problems.append(f"{path}: duplicate of {where}.legs[{seen[ident]}]")
        else:
            seen[ident] = k
    return problems


def _known(model: PolicyModel) -> str:
    return (
        "known: " + ", ".join(sorted(model.backends))
        if model.backends
        else "no backends are defined"
    )


def _limit(problems: list[str]) -> list[str]:
    if len(problems) <= MAX_REPORTED_PROBLEMS:
        return problems
    extra = len(problems) - MAX_REPORTED_PROBLEMS
    return [*problems[:MAX_REPORTED_PROBLEMS], f"... and {extra} more problems"]


# --- pydantic errors → "path: message" -------------------------------------------------------


def _problem(err: ErrorDetails) -> str:
    loc = tuple(err["loc"])
    return f"{format_path(loc)}: {_message(err, loc)}"


def format_path(loc: Sequence[int | str]) -> str:
    """``("rules", 2, "ratio")`` → ``rules[2].ratio``; odd dict keys are quoted."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]":
            out += " (key)"
        elif _PLAIN_KEY.match(part):
            out += f".{part}" if out else part
        else:
            out += '["' + part.replace('"', '\\"') + '"]'
    return out or "(top level)"


_TYPE_MESSAGES = {
    "missing": "is required",
    "int_type": "must be an integer, got {got}",
    "float_type": "must be a number, got {got}",
    "bool_type": "must be true or false, got {got}",
    "string_type": "must be a string, got {got}",
    "list_type": "must be a list, got {got}",
    "dict_type": "must be a mapping, got {got}",
    "model_type": "must be a mapping, got {got}",
    "model_attributes_type": "must be a mapping, got {got}",
    "finite_number": "must be a finite number, got {got}",
    "greater_than": "must be > {gt}, got {got}",
    "greater_than_equal": "must be >= {ge}, got {got}",
    "less_than": "must be < {lt}, got {got}",
    "less_than_equal": "must be <= {le}, got {got}",
    "too_short": "must list at least {min_length} item(s), got {got}",
    "string_too_short": "must not be empty",
}


def _message(err: ErrorDetails, loc: tuple[int | str, ...]) -> str:
    kind = err["type"]
    ctx: dict[str, Any] = dict(err.get("ctx") or {})
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "extra_forbidden":
        return _unknown_key(loc)
    if kind == "literal_error":
        expected = str(ctx.get("expected", "")).replace("False", "false")
        prefix = "must be one of" if " or " in expected else "must be"
        return f"{prefix} {expected}, got {_show(err['input'])}"
    template = _TYPE_MESSAGES.get(kind)
    if template is None:
        msg = err["msg"]
        return f"{msg[:1].lower()}{msg[1:]}, got {_show(err['input'])}"
    bounds = {k: f"{v:g}" if isinstance(v, float) else v for k, v in ctx.items()}
    return template.format(got=_show(err["input"]), **bounds)


def _show(value: object) -> str:
    """A found value, spelled the way YAML would show it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return f"a list of {len(value)}" if value else "an empty list"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unknown_key(loc: tuple[int | str, ...]) -> str:
    allowed = _fields_at(loc[:-1])
    key = loc[-1]
    if not allowed:
        return "unknown key"
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    if close:
        return f"unknown key (did you mean {close[0]!r}?)"
    return "unknown key (expected one of: " + ", ".join(allowed) + ")"


def _fields_at(loc: Sequence[int | str]) -> list[str]:
    """Field names of the model found by walking ``loc`` from PolicyModel ([] if not a model)."""
    current: Any = PolicyModel
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part) if isinstance(part, str) else None
            if field is None:
                return []
            current = field.annotation
        elif get_origin(current) is list:
            current = get_args(current)[0]
        elif get_origin(current) is dict:
            current = get_args(current)[1]
        else:
            return []
    current = _unwrap(current)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return []


def _unwrap(tp: Any) -> Any:
    """Strip ``Annotated[...]`` and ``X | None`` down to the type that holds fields."""
    while True:
        origin = get_origin(tp)
        if origin is Annotated:
            tp = get_args(tp)[0]
        elif origin in (Union, types.UnionType):
            args = [a for a in get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


# --- YAML ----------------------------------------------------------------------------------------


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate mapping keys (safe_load silently keeps the last one)."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue  # `<<: *anchor` merges may be overridden on purpose
        key = loader.construct_object(key_node, deep=True)
        try:
            if key in first_line:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first defined on line {first_line[key] + 1})",
                    key_node.start_mark,
                )
            first_line[key] = key_node.start_mark.line
        except TypeError:
            pass  # unhashable key: construct_mapping below reports it
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(yaml)"
    what = exc.problem or exc.context or "invalid YAML"
    return f"{where}: {what}"
