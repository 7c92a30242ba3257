"""Gateway tests (renderer, tool parsers, sessions, the served app)."""
