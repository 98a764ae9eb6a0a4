"""What a pass found: a Site is one linear or attention computation in a traced model.

Sites are plain data. The fields after `info` point into the fx graph that the site was found
in; they are what the rewrite needs and are never serialized (`describe()` gives the
SiteRecord that the plan stores).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.fx as fx


@dataclass
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str  # "float32", "float16", ...


@dataclass
class LinearInfo:
    """y = x W^T + b, whatever form the model wrote it in."""

    form: str  # "module" (nn.Linear) | "functional" (F.linear) | "addmm" | "matmul"
    in_features: int
    out_features: int
    bias: bool
    weight: str  # FQN of the weight parameter in the model
    bias_name: str | None  # FQN of the bias parameter, if any
    weight_layout: str  # "out_in" (nn.Linear, x @ W.T) | "in_out" (Conv1D, x @ W)
    dtype: str  # the weight's dtype


@dataclass
class AttentionInfo:
    """softmax(q k^T * scale + mask) v over q, k, v laid out (batch, heads, seq, head_dim)."""

    form: str  # "sdpa" | "handwritten" | "mha" (MhaInfo) | "window" (WindowInfo) | "varlen" (flash-attn's)
    heads: int | None = None
    kv_heads: int | None = None  # < heads for GQA/MQA
    head_dim: int | None = None
    scale: float | None = None  # None: 1/sqrt(head_dim), SDPA's default
    mask: str = "none"  # "none" | "additive" | "keep" (bool, True attends) | "drop" (bool, True is masked out)
    causal: bool = False
    # causal stands for a mask that tracing saw cover the scores, sliced to as many queries as keys
    # (nanoGPT's bias[:, :, :T, :T]): it holds where they are as many, or one query sees every key
    causal_from_mask: bool = False
    # a keep/drop mask from masked_fill/where with a finite value: a query row it masks whole gets
    # the softmax of equal scores, the mean of v (with -inf: zeros, the op's rule)
    finite_fill: bool = False
    dropout: float = 0.0
    dtype: str | None = None  # the site's parameters' dtype, where it owns some (an MHA module)


@dataclass
class MhaInfo(AttentionInfo):
    """An nn.MultiheadAttention: how the module was built (the op rebuilds it from these)."""

    embed_dim: int | None = None
    kdim: int | None = None
    vdim: int | None = None
    bias: bool | None = None
    batch_first: bool | None = None
    weights_unknown: bool = False  # its caller is not traced: whether it reads the attention weights is unknown


@dataclass
class WindowInfo(AttentionInfo):
    """An SpTr window-attention chain."""

    rel_pos: str = "none"  # "none" | "contextual" (SpTr's relative position tables)


@dataclass(frozen=True)
class GraphSignature:
    """The graph nodes the rewrite touches, by name: a site found again in a new trace of the same
    model is the same site exactly when these match."""

    args: list[str]
    output: str | None
    nodes: list[str]


@dataclass(frozen=True)
class SiteRecord:
    """What the plan keeps of a Site (Site.describe): its plain fields, no graph handles. It becomes
    JSON only in the plan's file (to_json / from_json)."""

    kind: str
    fqn: str
    region: str
    classes: list[str]
    info: LinearInfo | AttentionInfo
    input: TensorMeta | None
    output: TensorMeta | None
    unsupported: str | None
    module_backed: bool
    reads_parameter_device: bool
    frozen: list[str]
    graph: GraphSignature

    def to_json(self) -> dict:
        return {**asdict(self), "info": {"type": type(self.info).__name__, **asdict(self.info)}}

    @staticmethod
    def from_json(data: dict) -> SiteRecord:
        """The record of to_json's dict, which description_problem found nothing wrong with; older
        plans lack the fields after `unsupported` (their defaults) or hold older info records."""
        meta = {key: TensorMeta(tuple(data[key]["shape"]), data[key]["dtype"]) if data[key] else None
                for key in ("input", "output")}
        return SiteRecord(data["kind"], data["fqn"], data["region"], data["classes"], Site.info_from_dict(data["info"]),
                          meta["input"], meta["output"], data.get("unsupported"), data.get("module_backed", False),
                          data.get("reads_parameter_device", False), data.get("frozen", []),
                          GraphSignature(**data["graph"]))


@dataclass
class Site:
    kind: str  # "linear" | "attention"
    fqn: str  # where the op module lives in the converted model; the site's name everywhere
    region: str  # FQN of the traced region (graph) the site is in; "" is the whole model
    classes: list[str]  # MRO class names of the module that owns the site, for recipe matching
    info: LinearInfo | AttentionInfo
    input: TensorMeta | None = None  # main input (x, or q), from shape propagation
    output: TensorMeta | None = None
    unsupported: str | None = None  # why this site cannot be converted by any op, if so

    # Graph handles, valid for the graph the site was found in.
    args: tuple = field(default=(), repr=False, compare=False)  # op module's forward args
    output_node: fx.Node | None = field(default=None, repr=False, compare=False)
    nodes: list[fx.Node] = field(default_factory=list, repr=False, compare=False)
    module_backed: bool = field(default=False, compare=False)  # site is a whole submodule at fqn
    # Other traced code reads the device of the site module's weight or bias (`self.fc.weight.device`):
    # an op whose module keeps no such tensor cannot take the site.
    reads_parameter_device: bool = field(default=False, compare=False)
    frozen: list[str] = field(default_factory=list)  # op module parameters to keep requires_grad off

    def compute_dtype(self) -> str:
        """The dtype the site computes in: its input's as traced, else its parameters'."""
        meta = self.input or self.output
        return meta.dtype if meta else (self.info.dtype or "float32")

    def describe(self) -> SiteRecord:
        """What `inspect` prints and the plan stores."""
        return SiteRecord(self.kind, self.fqn, self.region, list(self.classes), replace(self.info), self.input,
                          self.output, self.unsupported, self.module_backed, self.reads_parameter_device,
                          list(self.frozen), self.graph_signature())  # a snapshot: later passes do not move it

    def graph_signature(self) -> GraphSignature:
        def name(a):
            return a.name if isinstance(a, fx.Node) else repr(a)

        return GraphSignature([name(a) for a in self.args],
                              name(self.output_node) if self.output_node is not None else None,
                              [n.name for n in self.nodes])

    @staticmethod
    def info_from_dict(d: dict) -> LinearInfo | AttentionInfo:
        d = legacy_info(d)
        return INFO_TYPES[d.pop("type")](**d)


INFO_TYPES = {"LinearInfo": LinearInfo, "AttentionInfo": AttentionInfo, "MhaInfo": MhaInfo, "WindowInfo": WindowInfo}
FORM_INFO_TYPES = {"mha": MhaInfo, "window": WindowInfo}  # the forms with fields of their own


def legacy_info(info: dict) -> dict:
    """A site's info as lowconv writes it now. Older plans hold every attention form's fields in one
    AttentionInfo record (rel_pos among them): such a record becomes its form's type (MhaInfo,
    WindowInfo, AttentionInfo), less the fields of the other forms."""
    info = dict(info)
    if info.get("type") != "AttentionInfo" or "rel_pos" not in info:
        return info
    form = info.get("form")
    cls = FORM_INFO_TYPES.get(form, AttentionInfo) if isinstance(form, str) else AttentionInfo
    names = {f.name for f in fields(cls)}
    return {"type": cls.__name__, **{key: value for key, value in info.items() if key in names}}


def description_problem(site: dict) -> str | None:
    """What in a site's description (SiteRecord.to_json, as a plan stores it) is not as lowconv
    writes it, where replaying it would fail inside lowconv (None: nothing found): its info's type
    and fields, its plain fields and graph, its input and output shapes and dtypes."""
    missing = [key for key in ("kind", "fqn", "region", "info", "input", "output", "graph") if key not in site]
    if missing:
        return f"it has no {', '.join(missing)}"
    info = site["info"]
    if not isinstance(info, dict) or info.get("type") not in INFO_TYPES:
        return f"its info's type is not one of {', '.join(INFO_TYPES)}"
    info = legacy_info(info)
    names = {f.name for f in fields(INFO_TYPES[info["type"]])}
    if set(info) - {"type"} != names:
        return f"its {info['type']} fields are {sorted(set(info) - {'type'})}, not {sorted(names)}"
    hints = typing.get_type_hints(INFO_TYPES[info["type"]])
    wrong = [name for name in sorted(names) if not fits(info[name], hints[name])]
    if wrong:
        return f"its {info['type']}.{wrong[0]} {str(info[wrong[0]])[:40]!r} is not a {type_name(hints[wrong[0]])}"
    plain = {key: hint for key, hint in typing.get_type_hints(SiteRecord).items()
             if key not in ("info", "input", "output")}
    for key, kind in plain.items():
        if key in site and not fits(site[key], kind):
            return f"its {key} {str(site[key])[:40]!r} is not a {type_name(kind)}"
    graph = typing.get_type_hints(GraphSignature)
    if set(site["graph"]) != set(graph) or not all(fits(site["graph"][key], hint) for key, hint in graph.items()):
        return f"its graph is not the names of its nodes (args, output, nodes): {str(site['graph'])[:80]}"
    if info.get("dtype") is not None and not is_dtype_name(info["dtype"]):
        return f"its info's dtype {str(info['dtype'])[:40]!r} is not a torch dtype"
    for key in ("input", "output"):
        meta = site.get(key)
        if meta is None:
            continue
        if not isinstance(meta, dict) or set(meta) != {"shape", "dtype"} or not isinstance(meta["shape"], list) \
                or not all(type(n) is int and n >= 0 for n in meta["shape"]) \
                or not is_dtype_name(meta["dtype"]):
            return f"its {key} is not a shape of sizes and a torch dtype: {str(meta)[:80]}"
    return None


def fits(value, hint) -> bool:
    """Whether a JSON value is of a dataclass field's type: int, float, str, bool, None, X | None,
    list[X], dict[K, V], list, dict, or a dataclass (an object here; its own fields are checked
    where it is read). A float field takes an int, as JSON writes 1.0; a bool is no int here."""
    origin = typing.get_origin(hint)
    if hint is type(None):
        return value is None
    if isinstance(hint, types.UnionType) or origin is typing.Union:
        return any(fits(value, option) for option in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(fits(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(fits(k, key) and fits(v, item) for k, v in value.items())
    if hint is float:
        return type(value) in (int, float)
    if hint in (int, str, bool, list, dict):
        return type(value) is hint
    if dataclasses.is_dataclass(hint):
        return isinstance(value, dict)
    raise TypeError(f"fits: no JSON form for {hint}")


def type_name(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint)


FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def is_dtype_name(name) -> bool:
    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def class_names(cls: type) -> list[str]:
    """A class's MRO names (what a recipe's class-name patterns match), `object` left out."""
    return [c.__name__ for c in cls.__mro__ if c is not object]


def tensor_meta(node) -> TensorMeta | None:
    """The shape/dtype that ShapeProp left on an fx node (None when shapes were not propagated)."""
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    if meta is None or not hasattr(meta, "shape"):
        return None
    return TensorMeta(tuple(meta.shape), dtype_name(meta.dtype))


def value_meta(value) -> TensorMeta | None:
    """The shape/dtype of a captured value: a tensor, or the first item of a tuple (a module's output)."""
    if isinstance(value, (tuple, list)) and value:
        value = value[0]
    if isinstance(value, torch.Tensor):
        return TensorMeta(tuple(value.shape), dtype_name(value.dtype))
    return None
