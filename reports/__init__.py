"""Reports: tables and figures regenerated from stored records, never by hand."""
