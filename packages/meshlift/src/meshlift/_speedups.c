/* meshlift._speedups: the per-call loops over Variables and attribute dicts, in C.
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

/* read_each(descriptor, objects) -> tuple(descriptor.__get__(o) for o in objects) */
static PyObject *
read_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects"};
    if (check_args("read_each", args, nargs, 2, names) < 0) {
        return NULL;
    }
    PyObject *descriptor = args[0], *objects = args[1];
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

/* write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair */
static PyObject *
write_each(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {NULL, "objects", "values"};
    if (check_args("write_each", args, nargs, 3, names) < 0) {
        return NULL;
    }
    PyObject *descriptor = args[0], *objects = args[1], *values = args[2];
    descrsetfunc set = Py_TYPE(descriptor)->tp_descr_set;
    if (set == NULL) {
        PyErr_Format(PyExc_TypeError, "write_each(): expected a data descriptor, got %.200s",
                     Py_TYPE(descriptor)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(objects);
    if (PyTuple_GET_SIZE(values) != n) {
        PyErr_Format(PyExc_ValueError, "write_each(): %zd objects but %zd values", n,
                     PyTuple_GET_SIZE(values));
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (set(descriptor, PyTuple_GET_ITEM(objects, i), PyTuple_GET_ITEM(values, i)) < 0) {
            return NULL;
        }
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

static PyMethodDef methods[] = {
    {"read_each", (PyCFunction)(void (*)(void))read_each, METH_FASTCALL,
     "read_each(descriptor, objects) -> tuple of descriptor.__get__(o)"},
    {"read_each_is", (PyCFunction)(void (*)(void))read_each_is, METH_FASTCALL,
     "read_each_is(descriptor, objects, expected) -> all(descriptor.__get__(o) is e)"},
    {"write_each", (PyCFunction)(void (*)(void))write_each, METH_FASTCALL,
     "write_each(descriptor, objects, values): descriptor.__set__(o, v) for each pair"},
    {"same_items", (PyCFunction)(void (*)(void))same_items, METH_FASTCALL,
     "same_items(dicts, sizes, keys, values) -> whether the dicts hold these items"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "meshlift._speedups",
    .m_doc = "The per-call loops of meshlift.speedups, in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    return PyModuleDef_Init(&module_def);
}
