"""Protocol shells over the gateway core: one module per wire protocol (chat.py: OpenAI Chat
Completions). Each validates its request, translates it into a `Conversation`, calls
`Gateway.complete` and answers in its own format; core.py's docstring says how one plugs in."""
