"""Reply parsers: `registry` (by SGLang's names, and "auto"), one module per family."""
