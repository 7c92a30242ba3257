"""The gateway: OpenAI / Anthropic protocols in, token-in-token-out records out.

Reading path: app.py (thin routes) -> protocols/ (wire <-> `Conversation`; fields.py says what
each request field does) -> core.py (the `Gateway` facade) -> prepare.py -> dispatch.py ->
record.py; renderers/ (ids <-> text, tool calls), sessions.py (turn trees), router.py (several
engine instances as one).
"""
