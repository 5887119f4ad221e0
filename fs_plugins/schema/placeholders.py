"""`/path/to/...` placeholders: the paper-scale YAMLs name what the user must supply (model
weights, downloaded data, a LoRA library) as `/path/to/<what>`. A config whose effective value
still is one is refused before anything loads, naming the key and where it was set, instead of
failing minutes later on a missing file."""
from __future__ import annotations

from collections.abc import Mapping

from fs_plugins.schema.fs_llm import leaves

PLACEHOLDER = '/path/to/'


def is_placeholder(value) -> bool:
    """Whether a value (a string, or a list of them) still holds a `/path/to/` placeholder."""
    if isinstance(value, (list, tuple)):
        return any(is_placeholder(item) for item in value)
    return isinstance(value, str) and PLACEHOLDER in value


def without_placeholders(node: Mapping) -> dict:
    """The mapping without the leaves that are placeholders (their defaults then apply): what
    a tiny stand-in of a paper-scale config keeps."""
    out = {}
    for key, value in node.items():
        if isinstance(value, Mapping):
            out[key] = without_placeholders(value)
        elif not is_placeholder(value):
            out[key] = value
    return out


def placeholder_problems(layers: list[tuple[Mapping, str]], overridable: bool = True,
                         methods: frozenset = frozenset()) -> list[str]:
    """One line per key whose effective value (the last layer that sets it wins) is still a
    placeholder, naming the key, the value and the layer (a YAML file or the command line).
    overridable: the key can also be given on the command line (not so a --client_cfg entry).
    methods: the registered method names; a placeholder under another method's node than the
    run's (fsplug.method) is not read by the run and does not stop it (a paper YAML names the
    public set of the baselines its table runs on it)."""
    effective: dict[str, tuple[object, str]] = {}
    for layer, source in layers:
        for key, value in leaves(layer):
            for other in [k for k in effective if k.startswith(key + '.')]:
                del effective[other]   # a layer that sets a whole node replaces its leaves
            effective[key] = (value, source)

    def advice(key: str, source: str) -> str:
        if source == 'command line':
            return 'replace it on the command line'
        if not overridable:
            return f'replace it in {source}'
        return f"replace it in {source} or give '{key} <value>' on the command line"
    method = str(effective.get('fsplug.method', ('', ''))[0])
    unread = tuple(f'fsplug.{name}.' for name in methods if name != method)
    return [f"{key}: '{value}' is a placeholder for a file or model you supply: "
            f'{advice(key, source)}'
            for key, (value, source) in effective.items()
            if is_placeholder(value) and not key.startswith(unread)]



def with_placeholders_filled(node: Mapping, root: str) -> dict:
    """The mapping with every `/path/to/<what>` replaced by `<root>/<what>`: a paper-scale
    config as a user who filled it in has it (the config fuzzing's starting point)."""
    def filled(value):
        if isinstance(value, Mapping):
            return {k: filled(v) for k, v in value.items()}
        if isinstance(value, list):
            return [filled(v) for v in value]
        return value.replace(PLACEHOLDER, root.rstrip('/') + '/') if isinstance(value, str) else value
    return filled(node)
