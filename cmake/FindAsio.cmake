# FindAsio.cmake -- locate standalone (non-Boost) Asio.
#
# Debian's libasio-dev ships /usr/include/asio.hpp but no CMake config, so
# this module finds the header and reads the version from asio/version.hpp.
#
# Result variables:
#   Asio_FOUND          - true if asio.hpp was found
#   Asio_INCLUDE_DIR    - directory containing asio.hpp (cache)
#   Asio_INCLUDE_DIRS   - same, for compatibility
#   Asio_VERSION        - e.g. 1.22.1
#
# Imported target:
#   Asio::Asio          - INTERFACE target with ASIO_STANDALONE,
#                         ASIO_NO_DEPRECATED and ASIO_HAS_STD_ALIGNED_ALLOC
#                         compile definitions.
#
# ASIO_HAS_STD_ALIGNED_ALLOC: Asio decides whether its inline
# aligned_new()/aligned_delete() use std::aligned_alloc and free, or operator
# new and delete, from _GLIBCXX_HAVE_ALIGNED_ALLOC, which only a libstdc++
# header defines. A translation unit that includes Asio before any of them
# (a test file whose first line is <asio/io_context.hpp>, first in its unity
# batch) chose operator new while every other chose aligned_alloc; the
# linker kept one copy of each inline function, and memory was allocated by
# one and freed by the other (ASan: alloc-dealloc-mismatch in every test
# that started a broker). Defined here, every unit makes the choice an
# ordinary unit makes (one that includes a standard header first), which is
# also what a user's own units that include <spindle/asio.h> make: so the
# library's copies of those functions and theirs agree (spindle.pc forces
# no -DASIO_* on its users).
#
# Hint: set Asio_ROOT (or ASIO_ROOT) to the prefix of a custom installation.

find_path(Asio_INCLUDE_DIR
  NAMES asio.hpp
  HINTS ${Asio_ROOT} ${ASIO_ROOT} ENV Asio_ROOT ENV ASIO_ROOT
  PATH_SUFFIXES include asio/include
  DOC "Directory containing the standalone asio.hpp")

set(Asio_VERSION "")
if(Asio_INCLUDE_DIR AND EXISTS "${Asio_INCLUDE_DIR}/asio/version.hpp")
  file(STRINGS "${Asio_INCLUDE_DIR}/asio/version.hpp" _asio_version_line
       REGEX "^#define[ \t]+ASIO_VERSION[ \t]+[0-9]+")
  if(_asio_version_line MATCHES "ASIO_VERSION[ \t]+([0-9]+)")
    set(_asio_v "${CMAKE_MATCH_1}")
    # ASIO_VERSION is XXYYZZ: major * 100000 + minor * 100 + patch.
    math(EXPR _asio_major "${_asio_v} / 100000")
    math(EXPR _asio_minor "${_asio_v} / 100 % 1000")
    math(EXPR _asio_patch "${_asio_v} % 100")
    set(Asio_VERSION "${_asio_major}.${_asio_minor}.${_asio_patch}")
    unset(_asio_v)
    unset(_asio_major)
    unset(_asio_minor)
    unset(_asio_patch)
  endif()
  unset(_asio_version_line)
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Asio
  REQUIRED_VARS Asio_INCLUDE_DIR
  VERSION_VAR Asio_VERSION)

if(Asio_FOUND)
  set(Asio_INCLUDE_DIRS "${Asio_INCLUDE_DIR}")
  if(NOT TARGET Asio::Asio)
    add_library(Asio::Asio INTERFACE IMPORTED)
    set_target_properties(Asio::Asio PROPERTIES
      INTERFACE_INCLUDE_DIRECTORIES "${Asio_INCLUDE_DIR}"
      INTERFACE_COMPILE_DEFINITIONS "ASIO_STANDALONE;ASIO_NO_DEPRECATED;ASIO_HAS_STD_ALIGNED_ALLOC=1")
    # Asio needs threads for its internal mutexes/condition variables.
    if(NOT TARGET Threads::Threads)
      find_package(Threads QUIET)
    endif()
    if(TARGET Threads::Threads)
      set_property(TARGET Asio::Asio APPEND PROPERTY
        INTERFACE_LINK_LIBRARIES Threads::Threads)
    endif()
  endif()
endif()

mark_as_advanced(Asio_INCLUDE_DIR)
