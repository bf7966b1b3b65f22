"""`python -m minfer.stress`: a soak and fault run against minfer.serve, with figures.

    python -m minfer.stress --model DIR --duration 60        # starts its own server
    python -m minfer.stress --base-url http://127.0.0.1:8000 --duration 60

It drives, all at once: concurrent streams (a fifth cancelled midway), structured-output requests
(regexes, choices, JSON schemas, grammars; each output that stops must meet its constraint), tool
calls (each naming a tool, its arguments valid),
connections that stay silent or idle, requests whose body never arrives,
streams read slowly or not at all, malformed requests, /health probes and
/metrics scrapes. Then it checks that nothing was lost: no 5xx or stack trace in
any reply, exact usage on every finished stream, every stalled connection
closed, nothing running or waiting and every KV block free afterwards, RSS
growth bounded, /health p99 bounded, and seeded streams identical when replayed
alone. With --model it starts the server itself (few KV blocks, so preemption
never stops; 2 s timeouts, so they fire within the run; float64, so a seeded
replay must match exactly, rounding aside; a chat template that renders tools, so that tool
requests are served whatever the checkpoint's), scans its log for
stack traces, and ends with SIGTERM in the middle of new load: the server must
exit 0 within its grace period, every open stream ending with an error event
and [DONE]. With --base-url it checks what HTTP can see; pass the server's
timeouts so it knows how long a stalled connection may live (and
--float64-server if it runs float64: replays that differ then fail).

Traffic goes to the given server only; every loop is bounded in time.
"""
