"""The Batch API: files, batches and their states, the runner that feeds lines to the pipeline."""
