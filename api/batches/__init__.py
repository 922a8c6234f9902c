"""The Batch API (OpenAI's, plus summary batches: pagedq/summaries.py).

- schemas: the batch object, the create body, what Redis keeps, job ids, output lines;
- lease: one replica at a time works on a batch;
- store: a batch's life in Redis (fan-out, progress, finalizing), refusing with BatchRefused;
- supervisor: every api advances every active batch;
- routes: the endpoints, where refusals become HTTP errors.
"""
