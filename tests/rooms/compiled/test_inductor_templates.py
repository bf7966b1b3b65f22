"""Inductor's kernel templates, compiled once per source while minfer builds (compiled/inductor_templates.py)."""

from torch._inductor.codegen.common import KernelTemplate

from minfer.compiled.inductor_templates import templates_compiled_once

SOURCE = "{{ name }}({{ body | indent_except_first(1) }})"


def test_a_build_compiles_each_source_once_and_renders_as_torch_does():
    plain = KernelTemplate._template_from_string(SOURCE)
    assert KernelTemplate._template_from_string(SOURCE) is not plain  # torch alone compiles at every use
    with templates_compiled_once():
        first = KernelTemplate._template_from_string(SOURCE)
        assert KernelTemplate._template_from_string(SOURCE) is first
        assert KernelTemplate._template_from_string(SOURCE + " ") is not first
        values = {"name": "kernel", "body": "a;\nb;"}
        assert first.render(values) == plain.render(values) == "kernel(a;\n    b;)"


def test_torch_gets_its_own_function_back_even_after_a_failed_build():
    original = KernelTemplate.__dict__["_template_from_string"].__func__
    try:
        with templates_compiled_once():
            raise RuntimeError("the build failed")
    except RuntimeError:
        pass
    assert KernelTemplate.__dict__["_template_from_string"].__func__ is original
    assert KernelTemplate._template_from_string(SOURCE) is not KernelTemplate._template_from_string(SOURCE)


def test_overlapping_builds_share_the_templates_and_the_last_to_end_gives_torch_its_function_back():
    original = KernelTemplate.__dict__["_template_from_string"].__func__
    first = templates_compiled_once()
    first.__enter__()
    template = KernelTemplate._template_from_string(SOURCE)
    with templates_compiled_once():  # another engine's build, on another thread, say
        assert KernelTemplate._template_from_string(SOURCE) is template
    assert KernelTemplate._template_from_string(SOURCE) is template  # the first build still runs
    first.__exit__(None, None, None)
    assert KernelTemplate.__dict__["_template_from_string"].__func__ is original
