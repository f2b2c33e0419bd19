"""connector: the kvtier side of LMCache (L0<->L1 on CPU, L1<->L2 on l2fs), tier config and replica launcher."""
