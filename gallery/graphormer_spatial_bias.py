"""Graphormer's spatial encoding: a learned bias per head and per shortest-path distance between two nodes."""
import math

import torch

from flexlab.gallery import Mods, Param, Variant


def generate_graphormer_spatial_bias(distance: torch.Tensor, bias: torch.Tensor):
    """`distance[i, j]` is the hop count from node i to node j (clipped to the table); `bias[h, d]` is learned."""

    def spatial_bias(score, b, h, q_idx, kv_idx):
        return score + bias[h, distance[q_idx, kv_idx]]

    return spatial_bias


def grid_graph_distances(num_nodes: int, max_distance: int, device="cpu") -> torch.Tensor:
    """Hop counts between the nodes of a square grid graph, numbered row by row (a stand-in for a molecule's
    shortest-path matrix), clipped at `max_distance`: int32 (num_nodes, num_nodes), shared by every batch row."""
    side = math.ceil(math.sqrt(num_nodes))
    node = torch.arange(num_nodes)
    row, col = node // side, node % side
    hops = (row[:, None] - row[None, :]).abs() + (col[:, None] - col[None, :]).abs()
    return hops.clamp(max=max_distance).to(torch.int32).to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", max_distance=16):
    distance = grid_graph_distances(Q_LEN, max_distance, device)
    generator = torch.Generator().manual_seed(0)
    bias = (0.5 * torch.randn(H, max_distance + 1, generator=generator)).to(device)
    return Mods(score_mod=generate_graphormer_spatial_bias(distance, bias),
                tensors={"distance": distance, "bias": bias})


VARIANT = Variant(
    name="graphormer_spatial_bias",
    description="Add a trainable bias[h, hops(i, j)] looked up through the graph's shortest-path matrix.",
    paper="https://arxiv.org/abs/2106.05234",
    kind="score",
    make=make,
    params=(Param("max_distance", 16, 1, 64, 1, "hop counts beyond this share the table's last entry"),),
    lengths_rule="Q_LEN == KV_LEN (queries and keys are the same graph nodes)",
    accepts=lambda q_len, kv_len: q_len == kv_len,
    trainable=("bias",),
)
