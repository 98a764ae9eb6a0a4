"""After the rewrite, SpTr's pair layout dropped where only converted window attention reads it.

get_indices_params builds index_0 and index_1, each (M,) with M the number of (query, key) pairs
(the sum of squared window sizes), with host syncs for n_max and M. A converted chain
(SparseWindowAttention) reads only index_0_offsets (N+1) and each query's first entry of index_1,
to make each point's row window. Where those ops are all that reads a get_indices_params call's
outputs but sort_idx (its index_0, index_1_offsets and n_max unread), the call becomes
get_window_rows (the same window partition and sort_idx) and the ops take its row windows: the
converted graph computes nothing of size M. A pair layout that anything else reads (a kept chain,
other code) stays as it is, and so does one made outside the traced region (a forward argument).

Only lowconv.compat.sptr's get_indices_params is replaced. A real SpTr install's partitions with
torch_geometric's voxel_grid, adds the shift before subtracting the minimum (other float rounding
at window borders) and orders points in a window by an unstable sort: its windows and sort_idx
need not be compat's, so get_window_rows could change what the model computes.

The rewrite runs this on every region it rewrote, on convert and on load alike, so a saved plan
replays it; the sites and their graph signatures are those found before it.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from lowconv.compat import sptr
from lowconv.ops.window_attention import SparseWindowAttention

# Positions in get_indices_params' tuple (index_0, index_0_offsets, n_max, index_1, index_1_offsets, sort_idx).
INDEX_0_OFFSETS, INDEX_1, SORT_IDX = 1, 3, 5
# Where the op takes index_0_offsets and index_1 (chain_site's args: q, k, v, index_0_offsets, index_1, ...).
OP_INDEX_0_OFFSETS, OP_INDEX_1 = 3, 4


def drop_pair_layouts(gm: fx.GraphModule) -> None:
    """Replace by get_window_rows each get_indices_params of gm whose pair layout only converted
    window attention reads; the caller recompiles."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is sptr.get_indices_params:
            items = tuple_items(node)
            if items is not None and only_window_ops_read(gm, items):
                to_window_rows(gm.graph, node, items)


def tuple_items(node: fx.Node) -> dict[fx.Node, int] | None:
    """Each user of node, a getitem, with its index; None if node is read otherwise."""
    items = {}
    for user in node.users:
        if not (user.target is operator.getitem and user.args[0] is node and isinstance(user.args[1], int)):
            return None
        items[user] = user.args[1]
    return items


def only_window_ops_read(gm: fx.GraphModule, items: dict[fx.Node, int]) -> bool:
    """Whether the pair layout (all items but sort_idx) is read by converted window attention only."""
    for item, index in items.items():
        if index == SORT_IDX:
            continue
        if index not in (INDEX_0_OFFSETS, INDEX_1) and item.users:
            return False
        if not all(takes_pair_layout(gm, call, items) for call in item.users):
            return False
    return True


def takes_pair_layout(gm: fx.GraphModule, call: fx.Node, items: dict[fx.Node, int]) -> bool:
    """Whether call is a converted window-attention op that takes its index_0_offsets and index_1
    from items, and each as that argument only."""
    if not (call.op == "call_module" and isinstance(gm.get_submodule(call.target), SparseWindowAttention)):
        return False
    offsets, index_1 = call.args[OP_INDEX_0_OFFSETS], call.args[OP_INDEX_1]
    return (items.get(offsets) == INDEX_0_OFFSETS and items.get(index_1) == INDEX_1
            and reads_once(call, offsets) and reads_once(call, index_1))


def reads_once(call: fx.Node, item: fx.Node) -> bool:
    return sum(a is item for a in (*call.args, *call.kwargs.values())) == 1


def to_window_rows(graph: fx.Graph, node: fx.Node, items: dict[fx.Node, int]) -> None:
    """node, a get_indices_params call, replaced by get_window_rows of its arguments."""
    with graph.inserting_before(node):
        rows = graph.call_function(sptr.get_window_rows, node.args, node.kwargs)
        rows.meta["is_wrapped"] = True  # as the tracer marks a wrapped call: a re-trace keeps it one node
        sort_idx, start, end = (graph.create_node("call_function", operator.getitem, (rows, i), name=name)
                                for i, name in enumerate(("sort_idx", "window_start", "window_end")))
    for item, index in items.items():
        if index == SORT_IDX:
            item.replace_all_uses_with(sort_idx)
        elif index == INDEX_0_OFFSETS:
            for call in list(item.users):
                call.args = (*call.args[:OP_INDEX_0_OFFSETS], None, None, *call.args[OP_INDEX_1 + 1:])
                call.kwargs = {**call.kwargs, "row_windows": (start, end)}
    for item in items:
        graph.erase_node(item)
    graph.erase_node(node)
