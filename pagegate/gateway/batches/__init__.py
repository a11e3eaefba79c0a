"""OpenAI's Files and Batch APIs (/v1/files, /v1/batches), durable under --batch-dir.

`disk` keeps file bytes, `store` the metadata and each line's result (SQLite), `lines` reads an input file,
`in_process` runs one line through the app's own route, `runner` runs and resumes batches, `assemble` writes their
output and error files, `service` ties them together for `routes`.
"""
