"""The PD router: one OpenAI-compatible endpoint in front of prefill, decode and mixed workers.

Read in the order a request flows: `requests` (validate a turn), `discovery` and `pool` (which
workers exist and how loaded they are), `placement` (where the turn's prefill and decode run),
`flow` (the prefill → KV transfer → decode exchange), `trajectories` (turns → lifecycle
events), `app` (HTTP wiring, metrics, health).
"""
