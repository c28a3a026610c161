"""Signed completion webhooks (issue #34; docs/webhooks.md).

    targets.py    which URLs may be targets (the SSRF guard): resolved, every address checked
    signing.py    Standard Webhooks secrets and signatures
    messages.py   a message's body (thin: ids, status, hashes, timing, links)
    delivery.py   ``Webhooks``: submissions' checks, secrets, the delivery log, the delivery loop

The messages themselves are in the task ledger's outbox (app/ledger/outbox.py), written with the
records they are about.
"""
