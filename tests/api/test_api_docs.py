"""docs/api.md is current and names every public name (`fdecode.devtools.api_docs`)."""

import importlib

import pytest

from fdecode.devtools import api_docs


def test_api_page_is_current():
  assert api_docs.DEFAULT_PATH.read_text() == api_docs.render(), (
      "docs/api.md is stale: run python -m fdecode.devtools.api_docs")


@pytest.mark.parametrize("module_name", api_docs.PUBLIC_MODULES)
def test_every_public_name_has_an_entry_with_a_docstring(module_name):
  page = api_docs.DEFAULT_PATH.read_text()
  module = importlib.import_module(module_name)
  for name in api_docs.public_names(module_name):
    qualname = f"{module_name}.{name}"
    assert f"`{qualname}" in page, f"{qualname} has no entry in docs/api.md"
    obj = getattr(module, name)
    if callable(obj):
      assert obj.__doc__, f"{qualname} has no docstring"


def test_a_module_without_all_is_refused():
  with pytest.raises(ValueError, match="declares no __all__"):
    api_docs.public_names("fdecode.api")
