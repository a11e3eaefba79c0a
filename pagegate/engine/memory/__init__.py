"""The engine's memory: its KV pages and their lifecycle. `pool` builds the scheduler over the runner's pages (in
one place), and sleeps, wakes and resizes the pool and takes LoRA adapters in and out; `elastic_pages` moves an
elastic pool's limit within the page budget several models share, kept in `page_ledger`. Importing this package
or `page_ledger` imports no torch (the gateway reads the ledger)."""
