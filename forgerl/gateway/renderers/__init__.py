"""Messages <-> token ids for the policy's chat template, and sampled text -> the client's reply.

renderer.py renders a conversation to ids with TITO (ChatML built in), templates.py wraps a
Hugging Face chat template, tool_parsers.py turns completion text into tool calls (one parser per
model family), replies.py cuts a choice at its stop strings and streams its reply. The gateway
core (core.py, prepare.py, dispatch.py, record.py) calls these; they import nothing above them.
"""
