# Fails when an object file compiled for one instruction set (*_avx2.cpp.o, *_avx512.cpp.o)
# defines a weak function (nm type W): the linker keeps one copy of such a symbol for the whole
# program, so a helper inlined from a shared header would run at one arbitrary ISA level for all
# callers (slower code, or AVX-512 instructions on a CPU without them). Weak data (type V, e.g.
# the exception-handling reference DW.ref.__gxx_personality_v0 of sanitizer builds) carries no
# instructions and is allowed.
# Usage: cmake -DNM=<nm> -DOBJECTS="<list>" -P check_isa_objects.cmake
if(NOT NM OR NOT OBJECTS)
  message(FATAL_ERROR "check_isa_objects: NM and OBJECTS must be set")
endif()
set(checked 0)
set(bad "")
foreach(obj IN LISTS OBJECTS)
  if(NOT obj MATCHES "_(avx2|avx512)\\.cpp\\.o$")
    continue()
  endif()
  math(EXPR checked "${checked} + 1")
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE syms RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "check_isa_objects: ${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${syms}")
  foreach(line IN LISTS lines)
    if(line MATCHES "^[0-9a-fA-F]+ W ")
      list(APPEND bad "${obj}: ${line}")
    endif()
  endforeach()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "check_isa_objects: no *_avx2/*_avx512 objects in the list")
endif()
if(bad)
  string(REPLACE ";" "\n  " msg "${bad}")
  message(FATAL_ERROR "Weak functions in per-ISA objects (make them static or put them in an "
                      "anonymous namespace):\n  ${msg}")
endif()
message(STATUS "check_isa_objects: ${checked} per-ISA objects, no weak functions")
