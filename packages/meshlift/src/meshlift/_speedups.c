/* meshlift._speedups: the per-call loops over Variables and attribute dicts, in C,
 * and a repeated call's two steps around its staged function (plan_inputs, plan_write).
 *
 * Each function has a pure-Python twin in meshlift/speedups.py, with the same
 * results; that module picks this one when it was built. Every loop runs over
 * tuples (immutable) or exact dicts; only a key that is not the same object as
 * before is compared by `==`, as Python's own list comparison does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Whether the call has one argument per name, each named one a tuple (names[k] NULL:
 * any object); else -1 with a TypeError naming the function and the argument. */
static int
check_args(const char *function, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
           const char *const *names)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", function, expected,
                     nargs);
        return -1;
    }
    for (Py_ssize_t k = 0; k < expected; k++) {
        if (names[k] != NULL && !PyTuple_CheckExact(args[k])) {
            PyErr_Format(PyExc_TypeError, "%s(): %s must be a tuple, not %.200s", function,
                         names[k], Py_TYPE(args[k])->tp_name);
            return -1;
        }
    }
    return 0;
}

static descrgetfunc
getter_of(PyObject *descriptor)
{
    descrgetfunc get = Py_TYPE(descriptor)->tp_descr_get;
    if (get == NULL) {
        PyErr_Format(PyExc_TypeError, "expected a descriptor, got %.200s",
                     Py_TYPE(descriptor)->tp_name);
    }
    return get;
}

/* tuple(descriptor.__get__(o) for o in objects); objects: a tuple */
static PyObject *
read_all(PyObject *descriptor, PyObject *objects)
{
    descrgetfunc get = getter_of(descriptor);
    if (get == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(objects);
    PyObject *out = PyTuple_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GET_ITEM(objects, i);
        PyObject *value = get(descriptor, obj, (PyObject *)Py_TYPE(obj));
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, value);
    }
    return out;
}

/* read_each(descriptor, objects) -> tuple(descriptor.__get__(o) for o in objects) */
static PyObject *
read_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects"};
    if (check_args("read_each", args, nargs, 2, names) < 0) {
        return NULL;
    }
    return read_all(args[0], args[1]);
}

/* read_each_is(descriptor, objects, expected) -> all(descriptor.__get__(o) is e ...) */
static PyObject *
read_each_is(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects", "expected"};
    if (check_args("read_each_is", args, nargs, 3, names) < 0) {
        return NULL;
    }
    PyObject *descriptor = args[0], *objects = args[1], *expected = args[2];
    descrgetfunc get = getter_of(descriptor);
    if (get == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(objects);
    if (PyTuple_GET_SIZE(expected) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = PyTuple_GET_ITEM(objects, i);
        PyObject *value = get(descriptor, obj, (PyObject *)Py_TYPE(obj));
        if (value == NULL) {
            return NULL;
        }
        int same = value == PyTuple_GET_ITEM(expected, i);
        Py_DECREF(value);
        if (!same) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* same_dicts(holders, dicts) -> whether each holder's attribute dict (its generic
 * `__dict__`) is the dict at the same position; a holder that is a weakref.ref is read
 * through it (collected: False). */
static PyObject *
same_dicts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"holders", "dicts"};
    if (check_args("same_dicts", args, nargs, 2, names) < 0) {
        return NULL;
    }
    PyObject *holders = args[0], *dicts = args[1];
    Py_ssize_t n = PyTuple_GET_SIZE(holders);
    if (PyTuple_GET_SIZE(dicts) != n) {
        Py_RETURN_FALSE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *holder = PyTuple_GET_ITEM(holders, i);
        PyObject *dict;
        if (PyWeakref_CheckRefExact(holder)) {
#if PY_VERSION_HEX >= 0x030D0000
            PyObject *referent;
            if (PyWeakref_GetRef(holder, &referent) < 0) {
                return NULL;
            }
#else
            PyObject *referent = Py_XNewRef(PyWeakref_GetObject(holder));
            if (referent == NULL) {
                return NULL;
            }
#endif
            if (referent == NULL || referent == Py_None) {
                Py_XDECREF(referent);
                Py_RETURN_FALSE;
            }
            dict = PyObject_GenericGetDict(referent, NULL);
            Py_DECREF(referent);
        }
        else {
            dict = PyObject_GenericGetDict(holder, NULL);
        }
        if (dict == NULL) {
            return NULL;
        }
        int same = dict == PyTuple_GET_ITEM(dicts, i);
        Py_DECREF(dict);
        if (!same) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* descriptor.__set__(o, v) for each pair, nothing written unless the lengths are equal;
 * objects and values: tuples. 0, or -1 with an error set. */
static int
write_all(const char *function, PyObject *descriptor, PyObject *objects, PyObject *values)
{
    descrsetfunc set = Py_TYPE(descriptor)->tp_descr_set;
    if (set == NULL) {
        PyErr_Format(PyExc_TypeError, "%s(): expected a data descriptor, got %.200s", function,
                     Py_TYPE(descriptor)->tp_name);
        return -1;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(objects);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "%s(): %zd objects but %zd values", function, n,
                     PyTuple_GET_SIZE(values));
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (set(descriptor, PyTuple_GET_ITEM(objects, i), PyTuple_GET_ITEM(values, i)) < 0) {
            return -1;
        }
    }
    return 0;
}

/* write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair */
static PyObject *
write_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects", "values"};
    if (check_args("write_each", args, nargs, 3, names) < 0) {
        return NULL;
    }
    if (write_all("write_each", args[0], args[1], args[2]) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* same_items(dicts, sizes, keys, values) -> whether each dict still has its size, and
 * all together, in order, keys equal to these holding these very values (the same
 * objects). dicts: a tuple of exact dicts; the rest as taken from them. */
static PyObject *
same_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"dicts", "sizes", "keys", "values"};
    if (check_args("same_items", args, nargs, 4, names) < 0) {
        return NULL;
    }
    PyObject *dicts = args[0], *sizes = args[1], *keys = args[2], *values = args[3];
    Py_ssize_t n = PyTuple_GET_SIZE(dicts), total = PyTuple_GET_SIZE(keys);
    if (PyTuple_GET_SIZE(sizes) != n || PyTuple_GET_SIZE(values) != total) {
        Py_RETURN_FALSE;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dict = PyTuple_GET_ITEM(dicts, i);
        if (!PyDict_CheckExact(dict)) {
            PyErr_Format(PyExc_TypeError, "same_items(): expected dicts, got %.200s",
                         Py_TYPE(dict)->tp_name);
            return NULL;
        }
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, i));
        if (size == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (PyDict_GET_SIZE(dict) != size || at + size > total) {
            Py_RETURN_FALSE;
        }
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (PyDict_Next(dict, &pos, &key, &value)) {
            if (value != PyTuple_GET_ITEM(values, at)) {
                Py_RETURN_FALSE;
            }
            PyObject *old_key = PyTuple_GET_ITEM(keys, at);
            if (key != old_key) {  /* attribute names: equal strings; else == as Python does */
                Py_INCREF(key);
                int equal = PyObject_RichCompareBool(key, old_key, Py_EQ);
                Py_DECREF(key);
                if (equal <= 0) {
                    return equal < 0 ? NULL : Py_NewRef(Py_False);
                }
            }
            at++;
        }
    }
    if (at != total) {
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* The fields of a CallPlan (meshlift/speedups.py), by position. */
enum {
    MESH_SOURCE,
    MESH,
    TYPES,
    NODE_POSITIONS,
    NODE_REFS,
    UNCHANGED,
    SLOT,
    VARIABLES,
    DYN_POSITIONS,
    DONATED_VARIABLES,
    DONATED_DYN_POSITIONS,
    INFO,
    CHANGED,
    TARGETS,
    ARRAY_TYPE,
    PLAN_FIELDS,
};

/* The fields that must be exact tuples. */
static const int plan_tuples[] = {
    TYPES, NODE_POSITIONS, NODE_REFS, VARIABLES, DYN_POSITIONS, DONATED_VARIABLES,
    DONATED_DYN_POSITIONS, CHANGED, TARGETS,
};

/* The plan (borrowed) if `args` are a CallPlan and one more object; else NULL, TypeError set. */
static PyObject *
plan_of(const char *function, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, NULL};
    if (check_args(function, args, nargs, 2, names) < 0) {
        return NULL;
    }
    PyObject *plan = args[0];
    if (!PyTuple_Check(plan) || PyTuple_GET_SIZE(plan) < PLAN_FIELDS) {
        PyErr_Format(PyExc_TypeError, "%s(): expected a CallPlan, got %.200s", function,
                     Py_TYPE(plan)->tp_name);
        return NULL;
    }
    for (size_t k = 0; k < sizeof(plan_tuples) / sizeof(plan_tuples[0]); k++) {
        if (!PyTuple_CheckExact(PyTuple_GET_ITEM(plan, plan_tuples[k]))) {
            PyErr_Format(PyExc_TypeError, "%s(): CallPlan field %d must be a tuple", function,
                         plan_tuples[k]);
            return NULL;
        }
    }
    return plan;
}

/* The item of `tuple` at the int `index`, borrowed; NULL, with no error set, if out of
 * range; NULL with an error if `index` is no int. */
static PyObject *
item_at(PyObject *tuple, PyObject *index)
{
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    return 0 <= i && i < PyTuple_GET_SIZE(tuple) ? PyTuple_GET_ITEM(tuple, i) : NULL;
}

/* Whether `result` (a new reference, released here; or NULL with an error set) is
 * `expected`: 1 or 0. An error of class `expected_error` is cleared and counts as 0; any
 * other gives -1. */
static int
is_expected(PyObject *result, PyObject *expected, PyObject *expected_error)
{
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(expected_error)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    int same = result == expected;
    Py_DECREF(result);
    return same;
}

/* 1 if the weak reference `ref` refers to `obj`, 0 if not (or dead), -1 on error. */
static int
refers_to(PyObject *ref, PyObject *obj)
{
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *referent;
    if (PyWeakref_GetRef(ref, &referent) < 0) {
        return -1;
    }
    int same = referent == obj;
    Py_XDECREF(referent);
    return same;
#else
    PyObject *referent = PyWeakref_GetObject(ref);
    return referent == NULL ? -1 : referent == obj;
#endif
}

/* tuple(items[i] for i in positions); None (a new reference) if a position is out of
 * range; NULL on error. */
static PyObject *
items_at(PyObject *items, PyObject *positions)
{
    Py_ssize_t m = PyTuple_GET_SIZE(positions);
    PyObject *out = PyTuple_New(m);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < m; k++) {
        PyObject *item = item_at(items, PyTuple_GET_ITEM(positions, k));
        if (item == NULL) {
            Py_DECREF(out);
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        PyTuple_SET_ITEM(out, k, Py_NewRef(item));
    }
    return out;
}

static int
compare_addresses(const void *a, const void *b)
{
    uintptr_t x = (uintptr_t) * (PyObject *const *)a, y = (uintptr_t) * (PyObject *const *)b;
    return (x > y) - (x < y);
}

/* Whether the donated objects are distinct and none is also kept (speedups.donated_alone):
 * 1 or 0, -1 on error. All four are tuples. */
static int
donated_alone(PyObject *kept_vars, PyObject *kept_dyn, PyObject *donated_vars,
              PyObject *donated_dyn)
{
    Py_ssize_t n_vars = PyTuple_GET_SIZE(donated_vars), n = n_vars + PyTuple_GET_SIZE(donated_dyn);
    if (n == 0) {
        return 1;
    }
    PyObject **donated = PyMem_New(PyObject *, n);
    if (donated == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        donated[i] = i < n_vars ? PyTuple_GET_ITEM(donated_vars, i)
                                : PyTuple_GET_ITEM(donated_dyn, i - n_vars);
    }
    qsort(donated, (size_t)n, sizeof(PyObject *), compare_addresses);
    int alone = 1;
    for (Py_ssize_t i = 1; i < n && alone; i++) {
        alone = donated[i] != donated[i - 1];
    }
    PyObject *kept[2] = {kept_vars, kept_dyn};
    for (int g = 0; g < 2 && alone; g++) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(kept[g]) && alone; i++) {
            PyObject *obj = PyTuple_GET_ITEM(kept[g], i);
            alone = bsearch(&obj, donated, (size_t)n, sizeof(PyObject *), compare_addresses) == NULL;
        }
    }
    PyMem_Free(donated);
    return alone;
}

/* plan_inputs(plan, args) -> the staged function's four inputs, or None if `args`
 * do not match the plan. */
static PyObject *
plan_inputs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *plan = plan_of("plan_inputs", args, nargs);
    if (plan == NULL) {
        return NULL;
    }
    PyObject *call_args = args[1];
    if (!PyTuple_CheckExact(call_args)) {
        PyErr_Format(PyExc_TypeError, "plan_inputs(): args must be a tuple, not %.200s",
                     Py_TYPE(call_args)->tp_name);
        return NULL;
    }
    PyObject *source = PyTuple_GET_ITEM(plan, MESH_SOURCE);
    if (source != Py_None) {  /* on an error the general path asks again, and raises it */
        int same = is_expected(PyObject_CallNoArgs(source), PyTuple_GET_ITEM(plan, MESH),
                               PyExc_Exception);
        if (same <= 0) {
            return same < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    PyObject *types = PyTuple_GET_ITEM(plan, TYPES);
    Py_ssize_t n = PyTuple_GET_SIZE(call_args);
    if (PyTuple_GET_SIZE(types) != n) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((PyObject *)Py_TYPE(PyTuple_GET_ITEM(call_args, i)) != PyTuple_GET_ITEM(types, i)) {
            Py_RETURN_NONE;
        }
    }
    PyObject *positions = PyTuple_GET_ITEM(plan, NODE_POSITIONS);
    PyObject *refs = PyTuple_GET_ITEM(plan, NODE_REFS);
    if (PyTuple_GET_SIZE(refs) != PyTuple_GET_SIZE(positions)) {
        Py_RETURN_NONE;
    }
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(positions); k++) {
        PyObject *node = item_at(call_args, PyTuple_GET_ITEM(positions, k));
        if (node == NULL) {
            return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        }
        int same = refers_to(PyTuple_GET_ITEM(refs, k), node);
        if (same <= 0) {
            return same < 0 ? NULL : Py_NewRef(Py_None);
        }
    }
    PyObject *verdict = PyObject_CallNoArgs(PyTuple_GET_ITEM(plan, UNCHANGED));
    if (verdict == NULL) {
        return NULL;
    }
    int unchanged = PyObject_IsTrue(verdict);
    Py_DECREF(verdict);
    if (unchanged <= 0) {
        return unchanged < 0 ? NULL : Py_NewRef(Py_None);
    }
    /* kept Variables, kept arguments, donated Variables, donated arguments */
    static const int group_fields[4] = {VARIABLES, DYN_POSITIONS, DONATED_VARIABLES,
                                        DONATED_DYN_POSITIONS};
    PyObject *inputs = PyTuple_New(4);
    if (inputs == NULL) {
        return NULL;
    }
    for (int g = 0; g < 4; g++) {
        PyObject *field = PyTuple_GET_ITEM(plan, group_fields[g]);
        PyObject *group = g % 2 == 0 ? read_all(PyTuple_GET_ITEM(plan, SLOT), field)
                                     : items_at(call_args, field);
        if (group == NULL || group == Py_None) {  /* an error, or a position out of range */
            Py_DECREF(inputs);
            return group;
        }
        PyTuple_SET_ITEM(inputs, g, group);
    }
    int alone = donated_alone(PyTuple_GET_ITEM(inputs, 0), PyTuple_GET_ITEM(inputs, 1),
                              PyTuple_GET_ITEM(inputs, 2), PyTuple_GET_ITEM(inputs, 3));
    if (alone <= 0) {  /* the general path names the shared array */
        Py_DECREF(inputs);
        return alone < 0 ? NULL : Py_NewRef(Py_None);
    }
    return inputs;
}

/* plan_write(plan, outputs) -> True once the staged outputs are written back as the plan
 * says; False, writing nothing, if they do not carry its trace info or a value to write
 * is not of its array type (a tracer, say). */
static PyObject *
plan_write(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *info_name = NULL;
    PyObject *plan = plan_of("plan_write", args, nargs);
    if (plan == NULL) {
        return NULL;
    }
    PyObject *outputs = args[1];
    if (!PyTuple_CheckExact(outputs) || PyTuple_GET_SIZE(outputs) != 4) {
        Py_RETURN_FALSE;
    }
    if (info_name == NULL && (info_name = PyUnicode_InternFromString("info")) == NULL) {
        return NULL;
    }
    int same = is_expected(PyObject_GetAttr(PyTuple_GET_ITEM(outputs, 3), info_name),
                           PyTuple_GET_ITEM(plan, INFO), PyExc_AttributeError);
    if (same < 0) {
        return NULL;
    }
    PyObject *var_out = PyTuple_GET_ITEM(outputs, 0);
    if (!same || !PyTuple_CheckExact(var_out)) {
        Py_RETURN_FALSE;
    }
    PyObject *new = items_at(var_out, PyTuple_GET_ITEM(plan, CHANGED));
    if (new == NULL) {
        return NULL;
    }
    if (new == Py_None) {  /* a position out of range */
        Py_DECREF(new);
        Py_RETURN_FALSE;
    }
    PyObject *array_type = PyTuple_GET_ITEM(plan, ARRAY_TYPE);
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(new); j++) {
        if ((PyObject *)Py_TYPE(PyTuple_GET_ITEM(new, j)) != array_type) {
            Py_DECREF(new);
            Py_RETURN_FALSE;
        }
    }
    int written = write_all("plan_write", PyTuple_GET_ITEM(plan, SLOT),
                            PyTuple_GET_ITEM(plan, TARGETS), new);
    Py_DECREF(new);
    if (written < 0) {
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"read_each", (PyCFunction)(void (*)(void))read_each, METH_FASTCALL,
     "read_each(descriptor, objects) -> tuple of descriptor.__get__(o)"},
    {"read_each_is", (PyCFunction)(void (*)(void))read_each_is, METH_FASTCALL,
     "read_each_is(descriptor, objects, expected) -> all(descriptor.__get__(o) is e)"},
    {"write_each", (PyCFunction)(void (*)(void))write_each, METH_FASTCALL,
     "write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair"},
    {"same_dicts", (PyCFunction)(void (*)(void))same_dicts, METH_FASTCALL,
     "same_dicts(holders, dicts) -> whether each holder (or weakref's referent) has that __dict__"},
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(dicts, sizes, keys, values) -> whether the dicts hold these items"},
    {"plan_inputs", (PyCFunction)(void (*)(void))plan_inputs, METH_FASTCALL,
     "plan_inputs(plan, args) -> the staged inputs of a call matching a CallPlan, or None"},
    {"plan_write", (PyCFunction)(void (*)(void))plan_write, METH_FASTCALL,
     "plan_write(plan, outputs) -> whether the staged outputs were written back"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "meshlift._speedups",
    .m_doc = "The per-call loops and repeated-call steps of meshlift.speedups, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module_def);
}
