"""Tree attention for speculative decoding (SpecInfer, Medusa): draft tokens form a tree verified in one pass."""
import torch

from flexlab.gallery import Mods, Param, Variant


def generate_tree_attention(ancestor: torch.Tensor, context_length: int):
    """Keys are the committed context followed by the tree; `ancestor[i, j]`: tree node j is i or an ancestor."""

    def tree_attention(b, h, q_idx, kv_idx):
        in_context = kv_idx < context_length
        node = torch.where(in_context, 0, kv_idx - context_length)
        return in_context | (~in_context & ancestor[q_idx, node])

    return tree_attention


def ancestor_table(num_nodes: int, branching: int, device="cpu") -> torch.Tensor:
    """A complete tree in breadth-first order (node i's parent is (i - 1) // branching), as an ancestor table."""
    table = torch.zeros(num_nodes, num_nodes, dtype=torch.bool)
    for i in range(num_nodes):
        j = i
        while True:
            table[i, j] = True
            if j == 0:
                break
            j = (j - 1) // branching
    return table.to(device)


def make(B, H, Q_LEN, KV_LEN, device="cpu", branching=2):
    ancestor = ancestor_table(Q_LEN, branching, device)
    return Mods(mask_mod=generate_tree_attention(ancestor, KV_LEN - Q_LEN), tensors={"ancestor": ancestor})


VARIANT = Variant(
    name="tree_attention",
    description="Each draft token sees the whole context plus its own ancestors in the speculation tree.",
    paper="https://arxiv.org/abs/2305.09781",
    kind="mask",
    make=make,
    params=(Param("branching", 2, 1, 8, 1, "children per node of the draft tree (1 = a single chain)"),),
    lengths_rule="Q_LEN <= KV_LEN: queries are the tree's nodes, keys are KV_LEN - Q_LEN context tokens then the tree",
    accepts=lambda q_len, kv_len: 1 <= q_len <= kv_len,
    example_lengths=(64, 320),
)
