"""Our worker pool: its workers, their load, placement and KV admission."""
