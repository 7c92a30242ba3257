"""Online RL from production traffic, behind a promotion gate (`forgerl serve` with [online]).

    user ──► gateway (OpenAI / Anthropic routes) ──► CanaryEngine ──► incumbent | candidate
                 └──► PrivatePool (consent, PII scrub) ──► SQLite pool
    POST /v1/online/feedback (late) ──► the trajectory's reward
    OnlineService.step: consented rewarded traffic ──► Trainer (CISPO, off-policy) ──► candidate
        ──► held-out gate ──► canary share ──► promote | roll back   (decisions.jsonl)

privacy.py: consent and the scrub hook; canary.py: the engine split by session; service.py:
the routes, the background trainer and the gate.
"""
