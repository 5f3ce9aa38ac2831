"""A request's rows as the index and the segments hold them: read (`rows`), resolved through prefix-cache references
(`references`), ended by an upload (`ends`) and summarised for the API (`summaries`)."""
