"""Policy YAML, written once: a policy (or a fragment of one) as plain data → the text of a policy
file, which :mod:`policies.parse` reads back as the same mapping.

Every command that writes policy YAML for a person to paste or for the gateway to load — the
report's ``rollout.yaml`` and recommendation, the demo's policies — builds the mapping and calls
:func:`policy_yaml`; none spells YAML by hand, so a name that YAML would read as something else
(``no``, ``1.0``, ``null``) is quoted, not silently a boolean, a number or nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

__all__ = ["policy_yaml"]


def policy_yaml(policy: Mapping[str, Any], *, comments: Sequence[str] = ()) -> str:
    """``policy`` as YAML in the keys' order, collections of scalars in flow style
    (``legs: [{backend: x, role: candidate}]`` reads as one leg per line), each of ``comments``
    a ``#`` line above it."""
    head = "".join(f"# {line}\n" if line else "#\n" for line in comments)
    body = yaml.dump(
        _plain(policy),
        Dumper=_Dumper,
        sort_keys=False,
        default_flow_style=None,
        allow_unicode=True,
        width=100,
    )
    return head + body


class _Dumper(yaml.SafeDumper):
    """The safe dumper, with a block sequence indented under its key (``rules:\n  - name: …``),
    as policy files are written by hand."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _mapping(dumper: yaml.SafeDumper, data: dict[str, Any]) -> yaml.MappingNode:
    """A mapping of scalars on one line (``{backend: x, role: candidate}``) up to
    :data:`_FLOW_KEYS` keys; a longer one (a rollout's guards) one key a line."""
    flow = False if len(data) > _FLOW_KEYS else None
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flow)


_FLOW_KEYS = 4
_Dumper.add_representer(dict, _mapping)


def _plain(value: Any) -> Any:
    """Mappings as dicts and sequences as lists (the safe dumper knows no tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
