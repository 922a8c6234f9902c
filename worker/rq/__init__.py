"""The RQ process: `pagedq worker` (BatchWorker), the plain-RQ job function, and what they
share (the progress publisher, building the engine from the service settings)."""
