"""Model adaptation, pure: the rule language (text, includes, composite transforms), rules applied to
the pieces (renames, slices, fused splits, rotary rows), hints on whose names a checkpoint holds, and
the shapes a model's config implies. Trainers declare their rules in it; the job applies them.
"""
