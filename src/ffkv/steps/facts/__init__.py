"""The `facts` step package (issue 47): fact sets (`.data`), causal tracing (`.trace`), and the
`ffkv facts` command group. The group and the registry entry are added once its pieces land."""
