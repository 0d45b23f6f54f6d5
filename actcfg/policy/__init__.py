"""The policy layer, no torch: bytes -> YAML nodes with positions (`loader`) -> a `Policy`
(`schema`) or located findings (`checker`, `diagnostics`), with did-you-mean (`suggest`)."""
