"""Attention over the paged KV cache, behind one interface that backends implement."""
