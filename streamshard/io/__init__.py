"""Storage: filesystems, retries, listing and catalogs, footers, byte-range fetches, row-group reads, the token-count pass. No torch."""
