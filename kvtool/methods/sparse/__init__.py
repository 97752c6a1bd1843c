"""Block-sparse attention: which stored blocks a decode step reads (RocketKV's stage 2)."""
