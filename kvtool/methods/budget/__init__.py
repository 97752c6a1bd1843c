"""Token budgets across layers: uniform, PyramidKV's linear pyramid, or weights fitted by `kvtool profile`."""
