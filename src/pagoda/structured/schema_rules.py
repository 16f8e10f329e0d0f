"""Recursion in a JSON schema that llguidance compiles but cannot run: `$ref` cycles and endless recursion.

llguidance compiles `{"$ref": "#"}` or a loop a -> b -> a, then fails at the first mask ("NoExtensionBias");
it compiles a schema whose every instance must contain another (a required property, or `minItems` > 0,
that leads back through `$ref`), then fails a few tokens in ("Too many items"). Both are decided here on
the schema alone, before compiling:

- a **`$ref` cycle**: a schema reaches itself through `$ref`, `allOf`, `anyOf` and `oneOf` alone, without
  writing anything in between;
- **recursion that cannot end**: a reachable schema has no finite instance, or allows an object (array)
  that cannot be completed. "Has a finite instance" is the least fixpoint of: a literal (`const`, `enum`)
  or a scalar type has one; an object has one when each required property's schema has; an array when its
  items' schema has or `minItems` is 0; `$ref` and `allOf` need all of theirs, `anyOf` and `oneOf` one.

Only local references (`#`, `#/json/pointer`) are followed; others are left to llguidance.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

# Keywords whose value is one subschema, or a list / map of them, that an instance's parts must match.
_ONE = ("items", "additionalProperties", "additionalItems")
_LIST = ("prefixItems", "allOf", "anyOf", "oneOf")
_MAP = ("properties", "patternProperties")
_TRANSPARENT = ("allOf", "anyOf", "oneOf")  # the instance itself matches the members: nothing is written between
_SCALARS = ("string", "number", "integer", "boolean", "null")


def recursion_problem(schema: Any) -> str | None:
    """Why the schema's recursion cannot run, or None."""
    nodes = _reachable(schema)
    cycle = _ref_cycle(nodes, schema)
    if cycle is not None:
        return (f"the JSON schema has a $ref cycle that writes nothing: {' -> '.join(cycle)} "
                "(a schema must not reach itself through $ref, allOf, anyOf or oneOf alone)")
    finite = _finite(nodes, schema)
    for pointer, node in nodes.items():
        if not isinstance(node, dict) or "const" in node or "enum" in node:
            continue
        if not finite[pointer] or not _branches_end(node, pointer, nodes, schema, finite, any_branch=False):
            return (f"the JSON schema's recursion cannot end at {pointer}: every instance there must contain "
                    "another (through a required property or minItems, back through $ref)")
    return None


def _reachable(schema: Any) -> dict[str, Any]:
    """Every subschema an instance can reach from the root, by JSON pointer, in discovery order."""
    nodes: dict[str, Any] = {}
    pending = [("#", schema)]
    while pending:
        pointer, node = pending.pop()
        if pointer in nodes:
            continue
        nodes[pointer] = node
        for child in _children(pointer, node):
            pending.append(child)
        target = _ref_target(node, schema)
        if target is not None:
            pending.append(target)
    return nodes


def _children(pointer: str, node: Any) -> Iterator[tuple[str, Any]]:
    if not isinstance(node, dict):
        return
    for key in _ONE:
        if isinstance(node.get(key), (dict, bool)):
            yield f"{pointer}/{key}", node[key]
    for key in _LIST + ("items",):
        if isinstance(node.get(key), list):
            for index, member in enumerate(node[key]):
                yield f"{pointer}/{key}/{index}", member
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, member in node[key].items():
                yield f"{pointer}/{key}/{_escape(name)}", member


def _ref_target(node: Any, root: Any) -> tuple[str, Any] | None:
    """(pointer, schema) of a node's local $ref; None without one or when it cannot be resolved here."""
    ref = node.get("$ref") if isinstance(node, dict) else None
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    target, tokens = root, [unquote(token).replace("~1", "/").replace("~0", "~") for token in ref[2:].split("/")]
    for token in tokens if ref != "#" else []:
        if isinstance(target, dict) and token in target:
            target = target[token]
        elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
            target = target[int(token)]
        else:
            return None
    return "#" + "".join(f"/{_escape(token)}" for token in (tokens if ref != "#" else [])), target


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def _ref_cycle(nodes: dict[str, Any], root: Any) -> list[str] | None:
    """A cycle through $ref and the transparent keywords, as pointers (first = last), or None."""
    edges: dict[str, list[str]] = {}
    for pointer, node in nodes.items():
        targets = []
        target = _ref_target(node, root)
        if target is not None:
            targets.append(target[0])
        for key in _TRANSPARENT:
            if isinstance(node, dict) and isinstance(node.get(key), list):
                targets += [f"{pointer}/{key}/{index}" for index in range(len(node[key]))]
        edges[pointer] = targets
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in nodes:
        if start in state:
            continue
        path, iterators = [start], [iter(edges[start])]
        state[start] = 1
        while iterators:
            following = next(iterators[-1], None)
            if following is None:
                state[path.pop()] = 2
                iterators.pop()
            elif state.get(following) == 1:
                return path[path.index(following):] + [following]
            elif following not in state and following in edges:
                state[following] = 1
                path.append(following)
                iterators.append(iter(edges[following]))
    return None


def _finite(nodes: dict[str, Any], root: Any) -> dict[str, bool]:
    """Whether each node has a finite instance: the least fixpoint, children first (reverse discovery order)."""
    finite = {pointer: False for pointer in nodes}
    order = list(reversed(nodes))
    changed = True
    while changed:
        changed = False
        for pointer in order:
            if not finite[pointer] and _node_ends(nodes[pointer], pointer, nodes, root, finite):
                finite[pointer] = changed = True
    return finite


def _node_ends(node: Any, pointer: str, nodes: dict[str, Any], root: Any, finite: dict[str, bool]) -> bool:
    if not isinstance(node, dict):
        return node is not False
    if "const" in node or "enum" in node:
        return True
    target = _ref_target(node, root)
    if target is not None and not finite.get(target[0], True):
        return False
    for key in _TRANSPARENT:
        members = node.get(key)
        if isinstance(members, list) and members:
            ends = [finite.get(f"{pointer}/{key}/{index}", True) for index in range(len(members))]
            if not (all(ends) if key == "allOf" else any(ends)):
                return False
    return _branches_end(node, pointer, nodes, root, finite, any_branch=True)


def _branches_end(node: dict[str, Any], pointer: str, nodes: dict[str, Any], root: Any, finite: dict[str, bool],
                  any_branch: bool) -> bool:
    """any_branch: some type the node allows can be completed; else: every type it allows can."""
    types = node.get("type")
    allowed = [types] if isinstance(types, str) else types if isinstance(types, list) else [*_SCALARS, "object",
                                                                                               "array"]
    ends = []
    for kind in allowed:
        if kind == "object":
            properties = node.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = node.get("required")
            required = required if isinstance(required, list) else []
            ends.append(all(finite.get(f"{pointer}/properties/{_escape(name)}", True)
                            for name in required if isinstance(name, str) and name in properties))
        elif kind == "array":
            ends.append(_array_ends(node, pointer, finite))
        else:
            ends.append(True)
    return any(ends) if any_branch else all(ends)


def _array_ends(node: dict[str, Any], pointer: str, finite: dict[str, bool]) -> bool:
    min_items = node.get("minItems", 0)
    if not isinstance(min_items, int) or min_items <= 0:
        return True
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    needed = [f"{pointer}/prefixItems/{index}" for index in range(min(min_items, len(prefix)))]
    if min_items > len(prefix):
        needed.append(f"{pointer}/items")
    return all(finite.get(item, True) for item in needed)
