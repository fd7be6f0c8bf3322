"""Core: the algorithms, model-free (tensors in, tensors out). Imports nothing else of specmesh.

sampling (warp, seeded generators), tree (DraftTree), drafting (TreeSpec, build_tree), verification
(verify_tree, Verdict), methods (Method), rounds (the rules every round follows), adaptive (depth
policy), stats (GenerationStats). See docs/architecture.md.
"""
