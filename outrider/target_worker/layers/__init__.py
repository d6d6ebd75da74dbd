"""Building blocks shared by the architecture files: norms, RoPE, parallel linears, attention."""
