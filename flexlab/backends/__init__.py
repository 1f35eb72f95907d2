"""Attention backends behind `flexlab.flex_attention`: reference math, torch's compiled flex, our CuTeDSL kernels."""
